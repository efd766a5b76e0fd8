"""Per-request-slot cache of the drafter's context keys and values (paper Eq 3).

The injected context K/V of draft layer i is W_i^K H_ctx and W_i^V H_ctx (after k_norm and
RoPE for the keys). H_ctx depends only on the target's hidden taps of committed tokens, never
on a draft block, so each committed position is projected once and kept across rounds: a
round only adds the positions committed since the previous one, as DeepSpec's evaluator does
with its draft DynamicCache (``deepspec/eval/dspark/draft_ops.py``: the cache is cropped back
to the anchor position after every block).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftContextCache:
    """Context K/V of every draft layer for ``num_slots`` request slots.

    k, v:    [num_layers, num_slots, max_len, num_kv_heads, head_dim] in the drafter's dtype;
             keys are stored after k_norm and RoPE at their absolute positions.
    lengths: [num_slots] int64; positions 0..lengths[s]-1 of slot s hold context.
    """

    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def empty(cls, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype, device: torch.device | str) -> "DraftContextCache":
        """A zero-length cache. Raises ValueError for non-positive sizes."""
        if min(num_layers, num_slots, max_len, num_kv_heads, head_dim) <= 0:
            raise ValueError("cache dimensions must all be > 0")
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        return cls(k=torch.zeros(shape, dtype=dtype, device=device),
                   v=torch.zeros(shape, dtype=dtype, device=device),
                   lengths=torch.zeros(num_slots, dtype=torch.int64, device=device))

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def check_slots(self, slots: torch.Tensor) -> None:
        """Raises ValueError unless ``slots`` is an int64 vector of valid slot ids on the
        cache's device."""
        if slots.dim() != 1 or slots.dtype != torch.int64 or slots.device != self.k.device:
            raise ValueError(f"slots must be int64 [N] on {self.k.device}, got {slots.dtype} "
                             f"{tuple(slots.shape)} on {slots.device}")
        if slots.numel() and bool(((slots < 0) | (slots >= self.num_slots)).any()):
            raise ValueError(f"slot ids must be in [0, {self.num_slots})")

    def write(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store K/V of N context tokens and extend each touched slot's length to cover them.

        Args:
            slots, positions: [N] int64 (positions in [0, max_len)).
            k, v: [num_layers, N, num_kv_heads, head_dim].

        Raises:
            ValueError: bad slots or positions, or a write that would leave a gap between a
                slot's current length and the new positions.
        """
        self.check_slots(slots)
        if positions.shape != slots.shape or positions.dtype != torch.int64:
            raise ValueError("positions must be int64 with the shape of slots")
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
        self.k[:, slots, positions] = k.to(self.k.dtype)
        self.v[:, slots, positions] = v.to(self.v.dtype)
        self.lengths = new_len

    def reset(self, slots: torch.Tensor) -> None:
        """Forget the context of ``slots`` (a finished request's slot is being reused)."""
        self.check_slots(slots)
        self.lengths[slots] = 0
