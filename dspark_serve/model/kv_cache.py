"""Per-request KV cache of the target model: one contiguous slot of ``max_len`` token positions
per running request, for every layer.

A request owns a slot from ``allocate()`` to ``free()``; its token at absolute position p keeps
its keys/values at ``[layer, slot, :, p]``. The cache never tracks which positions hold valid
entries: the engine knows each request's committed length, and attention only reads positions
0..p of a query at position p (``dspark_serve.ops.varlen_attention``). Rolling back rejected
draft tokens therefore costs nothing: the next step overwrites their positions.

Capacity is counted in tokens so schedulers can admit requests by size: ``free_tokens`` is the
number of token positions in free slots (``num_free_slots * max_len``); it is back at
``capacity_tokens`` once every request has been freed.

Memory is ``2 * num_layers * num_slots * padded_len * num_kv_heads * head_dim`` elements,
``padded_len`` being ``max_len`` rounded up to attention's ``KV_BLOCK``; it is zero-filled,
because attention reads whole key blocks and a hidden entry still meets a zero probability
(0 * NaN would poison the output).
"""
from __future__ import annotations

import torch

from dspark_serve.ops.paged_attention import KV_BLOCK


class KVCache:
    """Keys and values of ``num_slots`` request slots.

    Attributes:
        k, v: [num_layers, num_slots, num_kv_heads, padded_len, head_dim] in the model
            dtype; keys after RoPE (and Qwen3's k_norm). ``paged(layer)`` shows one layer
            as the paged cache ``dspark_serve.ops.varlen_attention`` reads.
        page_table: [num_slots, 1] int64, slot s's one page is page s.

    Args:
        num_layers, num_slots, max_len, num_kv_heads, head_dim: sizes (all > 0).
        dtype, device: storage dtype and device.
    Raises:
        ValueError: a non-positive size.
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        sizes = dict(num_layers=num_layers, num_slots=num_slots, max_len=max_len,
                     num_kv_heads=num_kv_heads, head_dim=head_dim)
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        padded_len = -(-max_len // KV_BLOCK) * KV_BLOCK
        shape = (num_layers, num_slots, num_kv_heads, padded_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_table = torch.arange(num_slots, device=device)[:, None]
        self._max_len = max_len
        self.allocated = torch.zeros(num_slots, dtype=torch.bool)
        # Lowest free slot first keeps the used part of the cache compact.
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def max_len(self) -> int:
        """Most token positions one request can hold (prompt + completion)."""
        return self._max_len

    @property
    def head_dim(self) -> int:
        return self.k.shape[4]

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Token positions of the whole cache, ``num_slots * max_len``."""
        return self.num_slots * self.max_len

    @property
    def free_tokens(self) -> int:
        """Token positions in free slots, ``num_free_slots * max_len``."""
        return self.num_free_slots * self.max_len

    def allocate(self) -> int:
        """Reserve a slot for a new request and return its id.

        Raises:
            RuntimeError: every slot is in use (the scheduler must wait for a ``free``).
        """
        if not self._free:
            raise RuntimeError(f"KV cache full: all {self.num_slots} slots are in use")
        slot = self._free.pop()
        self.allocated[slot] = True
        return slot

    def free(self, slot: int) -> None:
        """Return a finished (or aborted) request's slot.

        Raises:
            ValueError: ``slot`` is out of range or not allocated.
        """
        if not 0 <= slot < self.num_slots or not bool(self.allocated[slot]):
            raise ValueError(f"slot {slot} is not an allocated slot of this cache")
        self.allocated[slot] = False
        self._free.append(slot)
        self._free.sort(reverse=True)

    def check_tokens(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Raises ValueError unless ``slots`` and ``positions`` are int64 [T] on the cache
        device, every slot is allocated, every position is in [0, max_len) and no (slot,
        position) pair repeats (two writes to one entry in a step would race)."""
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
        if not bool(self.allocated[slots.cpu()].all()):
            raise ValueError("every slot must be allocated (KVCache.allocate) before use")
        if bool(((positions < 0) | (positions >= self.max_len)).any()):
            raise ValueError(f"positions must be in [0, {self.max_len}) (the cache's max_len)")
        if torch.unique(slots * self.max_len + positions).numel() != slots.numel():
            raise ValueError("a (slot, position) pair occurs twice in one step")

    def paged(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values as a paged cache [num_slots, padded_len, Hkv, D]
        (views: one page of ``padded_len`` positions per slot, addressed by ``page_table``)."""
        return self.k[layer].transpose(1, 2), self.v[layer].transpose(1, 2)

    def write_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row indices [T * num_kv_heads] int64 of the tokens' entries in a layer's cache
        viewed as [num_slots * num_kv_heads * padded_len, head_dim] (token-major, then head);
        computed once per step and passed to ``write``."""
        heads = torch.arange(self.num_kv_heads, device=slots.device)
        rows = (slots[:, None] * self.num_kv_heads + heads) * self.k.shape[3] + positions[:, None]
        return rows.reshape(-1)

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's keys and values [T, num_kv_heads, head_dim] of one layer at
        ``rows`` (from ``write_rows``)."""
        flat = (-1, self.head_dim)
        self.k[layer].view(flat).index_copy_(0, rows, k.reshape(flat).to(self.k.dtype))
        self.v[layer].view(flat).index_copy_(0, rows, v.reshape(flat).to(self.v.dtype))
