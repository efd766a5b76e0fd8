"""Per-request-slot cache of the drafter's context keys and values (paper Eq 3).

The injected context K/V of draft layer i is W_i^K H_ctx and W_i^V H_ctx (after k_norm and
RoPE for the keys). H_ctx depends only on the target's hidden taps of committed tokens, never
on a draft block, so each committed position is projected once and kept across rounds: a
round only adds the positions committed since the previous one, as DeepSpec's evaluator does
with its draft DynamicCache (``deepspec/eval/dspark/draft_ops.py``: the cache is cropped back
to the anchor position after every block).

Storage is paged like the target's KV pool (``model.kv_cache``): a slot takes pages of
``PAGE_SIZE`` positions as its context grows and returns them on ``reset``, and the page
store doubles when every page is taken. Memory therefore follows the context the slots hold
together (at most twice its peak), not ``num_slots * max_len``: at the default model's 8192
context and 16 slots a preallocated cache would take 192 MiB for the default drafter (2
layers, 3 KV heads of 64, bfloat16), and ~10 GiB for an 8B target's drafter.
"""
from __future__ import annotations

import torch

from dspark_serve.ops.page_table import PageTable

# Positions per page; a slot starts with one page (the store with one per slot).
PAGE_SIZE = 64


class DraftContextCache:
    """Context K/V of every draft layer for ``num_slots`` request slots.

    Attributes:
        k, v: [num_layers, num_pages, PAGE_SIZE, num_kv_heads, head_dim] in the drafter's
            dtype; keys are stored after k_norm and RoPE. Position p of slot s lives in page
            ``page_table[s, p // PAGE_SIZE]`` at offset ``p % PAGE_SIZE``.
        page_table: [num_slots, ceil(max_len / PAGE_SIZE)] int64 (``ops.page_table``;
            entries past a slot's pages are read only where masked).
        lengths: [num_slots] int64; positions 0..lengths[s]-1 of slot s hold context.
        h: [num_pages, PAGE_SIZE, state_dim] context states H_ctx, kept only when
            ``state_dim`` is given (an ``anchor_context`` drafter reads H_ctx[p - 1]); else None.

    A new cache is empty (every length 0). Raises ValueError for non-positive sizes.
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 state_dim: int | None = None):
        if min(num_layers, num_slots, max_len, num_kv_heads, head_dim, state_dim or 1) <= 0:
            raise ValueError("cache dimensions must all be > 0")
        shape = (num_layers, num_slots, PAGE_SIZE, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.h = (None if state_dim is None else
                  torch.zeros(num_slots, PAGE_SIZE, state_dim, dtype=dtype, device=device))
        self._pages = PageTable(num_slots, -(-max_len // PAGE_SIZE), num_slots, device)
        self.lengths = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self._max_len = max_len

    @property
    def page_table(self) -> torch.Tensor:
        return self._pages.table

    @property
    def num_slots(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def num_pages(self) -> int:
        """Pages in the store (held or free)."""
        return self.k.shape[1]

    def check_slots(self, slots: torch.Tensor) -> None:
        """Raises ValueError unless ``slots`` is an int64 vector of valid slot ids on the
        cache's device."""
        if slots.dim() != 1 or slots.dtype != torch.int64 or slots.device != self.k.device:
            raise ValueError(f"slots must be int64 [N] on {self.k.device}, got {slots.dtype} "
                             f"{tuple(slots.shape)} on {slots.device}")
        if slots.numel() and bool(((slots < 0) | (slots >= self.num_slots)).any()):
            raise ValueError(f"slot ids must be in [0, {self.num_slots})")

    def write(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, h: torch.Tensor | None = None) -> None:
        """Store K/V (and context states) of N context tokens and extend each touched slot's
        length to cover them.

        Args:
            slots, positions: [N] int64 (positions in [0, max_len)).
            k, v: [num_layers, N, num_kv_heads, head_dim].
            h: [N, state_dim] context states; required exactly when the cache keeps them.

        Raises:
            ValueError: bad slots or positions, or a write that would leave a gap between a
                slot's current length and the new positions.
        """
        self.check_slots(slots)
        if positions.shape != slots.shape or positions.dtype != torch.int64:
            raise ValueError("positions must be int64 with the shape of slots")
        if (h is None) != (self.h is None):
            raise ValueError("context states must be written exactly when the cache keeps them")
        if slots.numel() == 0:
            return
        if bool(((positions < 0) | (positions >= self.max_len)).any()):
            raise ValueError(f"positions must be in [0, {self.max_len})")
        new_len = self.lengths.clone().scatter_reduce_(0, slots, positions + 1, reduce="amax")
        # Positions past a slot's old length must fill old_len..new_len-1 exactly: a hole
        # would later be attended to as if it held context.
        beyond = (positions >= self.lengths[slots]).to(torch.int64)
        grown = torch.zeros_like(self.lengths).scatter_add_(0, slots, beyond)
        if not bool((grown == new_len - self.lengths).all()):
            raise ValueError("context positions must continue each slot without gaps")
        for slot, length in enumerate(new_len.tolist()):
            while not self._pages.grow(slot, -(-length // PAGE_SIZE)):
                self._grow()
        pages = self.page_table[slots, positions // PAGE_SIZE]
        offsets = positions % PAGE_SIZE
        self.k[:, pages, offsets] = k.to(self.k.dtype)
        self.v[:, pages, offsets] = v.to(self.v.dtype)
        if h is not None:
            self.h[pages, offsets] = h.to(self.h.dtype)
        self.lengths = new_len

    def context(self, layer: int, slots: torch.Tensor,
                length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [R, length, num_kv_heads, head_dim] of positions 0..length-1 of
        ``slots`` [R] in ``layer`` (a gathered copy; positions past a slot's own length hold
        unrelated finite values, to be masked)."""
        n = -(-length // PAGE_SIZE)
        table = self.page_table[slots, :n]
        r = table.shape[0]
        return tuple(c[layer][table].view(r, n * PAGE_SIZE, *c.shape[3:])[:, :length]
                     for c in (self.k, self.v))

    def states(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Context states [R, state_dim] of ``slots`` [R] at ``positions`` [R] int64 (each
        below its slot's length); zeros where a position is -1 (an anchor with no context).
        Raises ValueError when the cache keeps no states."""
        if self.h is None:
            raise ValueError("this cache keeps no context states (state_dim None)")
        p = positions.clamp_min(0)
        out = self.h[self.page_table[slots, p // PAGE_SIZE], p % PAGE_SIZE]
        return torch.where((positions >= 0)[:, None], out, torch.zeros_like(out))

    def reset(self, slots: torch.Tensor) -> None:
        """Forget the context of ``slots`` and return their pages (a finished request's slot
        is being reused)."""
        self.check_slots(slots)
        self.lengths[slots] = 0
        for slot in slots.tolist():
            self._pages.release(slot)

    def _grow(self) -> None:
        """Double the page store (new pages zeroed, so every entry stays finite)."""
        self._pages.add_pages(self.num_pages)
        self.k, self.v = (torch.cat([c, torch.zeros_like(c)], dim=1) for c in (self.k, self.v))
        if self.h is not None:
            self.h = torch.cat([self.h, torch.zeros_like(self.h)])
