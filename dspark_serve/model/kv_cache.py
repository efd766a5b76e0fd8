"""KV cache of the target model: fixed-size pages shared by the running requests.

Every layer stores ``num_pages`` pages of ``page_size`` token positions. A request holds a
slot (a row of ``page_table``) from ``allocate()`` to ``free()``; its token at absolute
position p keeps its keys/values in page ``page_table[slot, p // page_size]`` at offset
``p % page_size``. A slot's pages are reserved as its tokens grow (``reserve``), taken from
one free list (lowest page id first) and all returned by ``free``, so memory follows the
tokens the requests actually hold and a freed page serves any later request.

Two layouts:
- a pool (``page_size`` and ``num_pages`` given): the engine's, pages of one ``KV_BLOCK``
  (``PAGE_SIZE``), sized by ``EngineConfig.kv_cache_tokens``;
- one page per slot (the default): ``page_size`` is ``max_len`` rounded up to ``KV_BLOCK``,
  ``num_pages == num_slots`` and ``allocate()`` reserves a whole slot, so slot s holds page s:
  the contiguous per-request cache the offline tools (profiling, feature extraction, eval)
  fill with sequences of known length.

The cache never tracks which positions hold valid entries: the engine knows each request's
committed length, and attention only reads positions 0..p of a query at position p
(``dspark_serve.ops.varlen_attention``). Rolling back rejected draft tokens therefore costs
nothing: the next step overwrites their positions.

Capacity is counted in tokens so schedulers can admit requests by size: ``free_tokens`` is
the number of positions new requests can still reserve (free pages * page_size, at most
``max_len`` per free slot); it is back at ``capacity_tokens`` once every request is freed.

Memory is ``2 * num_layers * num_pages * page_size * num_kv_heads * head_dim`` elements. It
is zero-filled and pages keep their last request's (finite) entries when freed, because
attention reads whole key blocks and a hidden entry still meets a zero probability
(0 * NaN would poison the output).
"""
from __future__ import annotations

import heapq

import torch

from dspark_serve.ops.page_table import PageTable
from dspark_serve.ops.paged_attention import KV_BLOCK

# The engine pool's page: one attention key block, so a request wastes less than a block
# and the keys attention reads (whole blocks) are exactly its pages.
PAGE_SIZE = KV_BLOCK


class KVCache:
    """Keys and values of ``num_slots`` request slots in ``num_pages`` pages.

    Attributes:
        k, v: [num_layers, num_pages, num_kv_heads, page_size, head_dim] in the model dtype;
            keys after RoPE (and Qwen3's k_norm). ``paged(layer)`` shows one layer as the
            paged cache ``dspark_serve.ops.varlen_attention`` reads.
        page_table: [num_slots, ceil(max_len / page_size)] int64 on the cache device: slot s's
            j-th page holds its positions j * page_size ... (j + 1) * page_size - 1
            (``ops.page_table.PageTable``; entries past a slot's pages are never read).
        allocated: [num_slots] bool (CPU), slots in use.

    Args:
        num_layers, num_slots, max_len, num_kv_heads, head_dim: sizes (all > 0); max_len is
            the most positions one request can hold.
        dtype, device: storage dtype and device.
        page_size: positions per page, a multiple of KV_BLOCK; None = max_len rounded up to
            KV_BLOCK (one page per slot).
        num_pages: pages of the pool; None = enough for every slot at max_len.
    Raises:
        ValueError: a non-positive size, a page size that is not a multiple of KV_BLOCK, or a
            pool too small for one request of max_len.
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, page_size: int | None = None,
                 num_pages: int | None = None):
        sizes = dict(num_layers=num_layers, num_slots=num_slots, max_len=max_len,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                     num_pages=num_pages)
        for name, value in sizes.items():
            if value is None and name in ("page_size", "num_pages"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if page_size is None:
            page_size = -(-max_len // KV_BLOCK) * KV_BLOCK
        elif page_size % KV_BLOCK:
            # attention pads the keys it reads to whole KV_BLOCKs of the slot's pages
            raise ValueError(f"page_size must be a multiple of {KV_BLOCK}, got {page_size}")
        slot_pages = -(-max_len // page_size)
        if num_pages is None:
            num_pages = num_slots * slot_pages
        elif num_pages < slot_pages:
            raise ValueError(f"{num_pages} pages of {page_size} positions cannot hold one request "
                             f"of max_len {max_len}")
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # One page per slot: slot s's pages start as page s, as its row already names.
        self._pages = PageTable(num_slots, slot_pages, num_pages, device)
        self._max_len = max_len
        self.allocated = torch.zeros(num_slots, dtype=torch.bool)
        self._reserved = torch.zeros(num_slots, dtype=torch.int64)  # positions per slot (CPU)
        self._free_slots = list(range(num_slots))  # a heap, lowest slot first

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def head_dim(self) -> int:
        return self.k.shape[4]

    @property
    def num_slots(self) -> int:
        return self.page_table.shape[0]

    @property
    def page_table(self) -> torch.Tensor:
        return self._pages.table

    @property
    def max_len(self) -> int:
        """Most token positions one request can hold (prompt + completion)."""
        return self._max_len

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_free_pages(self) -> int:
        return self._pages.num_free

    @property
    def capacity_tokens(self) -> int:
        """Token positions the cache can hold at once, ``min(num_pages * page_size,
        num_slots * max_len)``."""
        return min(self.num_pages * self.page_size, self.num_slots * self.max_len)

    @property
    def free_tokens(self) -> int:
        """Token positions new requests can still reserve, ``min(num_free_pages * page_size,
        num_free_slots * max_len)``."""
        return min(self.num_free_pages * self.page_size, self.num_free_slots * self.max_len)

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` positions."""
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether ``allocate(num_tokens)`` would succeed now (a free slot and enough pages)."""
        return bool(self._free_slots) and self.pages_for(num_tokens) <= self.num_free_pages

    def allocate(self, num_tokens: int | None = None) -> int:
        """Take a slot for a new request, with pages for its positions 0..num_tokens-1
        (None = max_len), and return its id.

        Raises:
            ValueError: num_tokens outside [0, max_len].
            RuntimeError: no free slot or too few free pages (the scheduler must wait for a
                ``free``).
        """
        num_tokens = self.max_len if num_tokens is None else num_tokens
        self._check_num_tokens(num_tokens)
        if not self._free_slots:
            raise RuntimeError(f"KV cache full: all {self.num_slots} slots are in use")
        if self.pages_for(num_tokens) > self.num_free_pages:
            raise RuntimeError(f"KV cache full: {num_tokens} positions need "
                               f"{self.pages_for(num_tokens)} pages, {self.num_free_pages} free")
        slot = heapq.heappop(self._free_slots)
        self.allocated[slot] = True
        self.reserve(slot, num_tokens)
        return slot

    def reserve(self, slot: int, num_tokens: int) -> bool:
        """Make ``slot`` hold positions 0..num_tokens-1, taking pages it lacks from the free
        list; False (and nothing taken) when too few pages are free.

        Raises:
            ValueError: ``slot`` is not allocated, or num_tokens outside [0, max_len].
        """
        self._check_slot(slot)
        self._check_num_tokens(num_tokens)
        if not self._pages.grow(slot, self.pages_for(num_tokens)):
            return False
        self._reserved[slot] = min(self._pages.num_held(slot) * self.page_size, self.max_len)
        return True

    def reserved_tokens(self, slot: int) -> int:
        """Positions ``slot`` can hold without another ``reserve``."""
        return int(self._reserved[slot])

    def pages_of(self, slot: int) -> list[int]:
        """The page ids ``slot`` holds, in position order (a copy)."""
        return self._pages.pages_of(slot)

    def free(self, slot: int) -> None:
        """Return a finished (or aborted) request's slot and all its pages.

        Raises:
            ValueError: ``slot`` is out of range or not allocated.
        """
        self._check_slot(slot)
        self.allocated[slot] = False
        self._pages.release(slot)
        self._reserved[slot] = 0
        heapq.heappush(self._free_slots, slot)

    def check_tokens(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Raises ValueError unless ``slots`` and ``positions`` are int64 [T] on the cache
        device, every slot is allocated, every position is in [0, max_len) and reserved for
        its slot, and no (slot, position) pair repeats (two writes to one entry in a step
        would race)."""
        for name, t in (("slots", slots), ("positions", positions)):
            if t.dim() != 1 or t.dtype != torch.int64 or t.device != self.k.device:
                raise ValueError(f"{name} must be int64 [T] on {self.k.device}, got {t.dtype} "
                                 f"{tuple(t.shape)} on {t.device}")
        if slots.shape != positions.shape:
            raise ValueError(f"slots {tuple(slots.shape)} and positions "
                             f"{tuple(positions.shape)} must have the same length")
        if slots.numel() == 0:
            return
        if bool(((slots < 0) | (slots >= self.num_slots)).any()):
            raise ValueError(f"slot ids must be in [0, {self.num_slots})")
        cpu_slots = slots.cpu()
        if not bool(self.allocated[cpu_slots].all()):
            raise ValueError("every slot must be allocated (KVCache.allocate) before use")
        if bool(((positions < 0) | (positions >= self.max_len)).any()):
            raise ValueError(f"positions must be in [0, {self.max_len}) (the cache's max_len)")
        if bool((positions.cpu() >= self._reserved[cpu_slots]).any()):
            raise ValueError("a position lies past its slot's reserved pages (KVCache.reserve)")
        if torch.unique(slots * self.max_len + positions).numel() != slots.numel():
            raise ValueError("a (slot, position) pair occurs twice in one step")

    def paged(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values as a paged cache [num_pages, page_size, Hkv, D]
        (views, addressed by ``page_table``)."""
        return self.k[layer].transpose(1, 2), self.v[layer].transpose(1, 2)

    def write_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row indices [T * num_kv_heads] int64 of the tokens' entries in a layer's cache
        viewed as [num_pages * num_kv_heads * page_size, head_dim] (token-major, then head);
        computed once per step and passed to ``write``."""
        heads = torch.arange(self.num_kv_heads, device=slots.device)
        pages = self.page_table[slots, positions // self.page_size]
        rows = ((pages[:, None] * self.num_kv_heads + heads) * self.page_size
                + (positions % self.page_size)[:, None])
        return rows.reshape(-1)

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's keys and values [T, num_kv_heads, head_dim] of one layer at
        ``rows`` (from ``write_rows``)."""
        flat = (-1, self.head_dim)
        self.k[layer].view(flat).index_copy_(0, rows, k.reshape(flat).to(self.k.dtype))
        self.v[layer].view(flat).index_copy_(0, rows, v.reshape(flat).to(self.v.dtype))

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or not bool(self.allocated[slot]):
            raise ValueError(f"slot {slot} is not an allocated slot of this cache")

    def _check_num_tokens(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.max_len:
            raise ValueError(f"num_tokens must be in [0, {self.max_len}], got {num_tokens}")
