"""Attention over flattened tokens of many requests, reading each request's KV cache slot.

One step's T tokens arrive flat, in any order, each with a marker (slot, position): a decode
token, a verify block of gamma + 1 tokens, or a prefill chunk of one request. Token t attends
causally to the keys of its own slot at positions 0..positions[t] -- the cached context plus
those of the step's own tokens at earlier (or equal) positions, which the caller writes to the
cache first. So the forward batch is never padded; padding exists only inside this call.

This PyTorch implementation is the CPU path and the reference for the fused CUDA kernel
(issue 7): it gathers the step's R distinct slots into a [R, Hkv, L, D] view (L = max
position + 1), lays the queries out as a [R, Hkv, G * max_q, D] grid (G = Hq / Hkv query heads
per KV head, so grouped-query attention never repeats K/V) and computes scores and outputs with
two matmuls in the model dtype and a float32 softmax (the arithmetic of transformers' eager
attention). ``plan_varlen`` does the per-step bookkeeping once for all layers.

Why not ``F.scaled_dot_product_attention``: on CPU its result for one query depends on how
many other queries share the call (measured: bf16 outputs differ between a decode token and
the same token inside a verify block, up to 0.4 in the final logits). The matmul + softmax
form gives every query row the same bits whatever the step's composition (measured in
bfloat16 on AVX512-BF16/AMX, 1 and 2 threads), under two conditions this module enforces:
the key length L is padded to a multiple of ``KV_BLOCK`` (unpadded, the probs @ V reduction
is blocked differently and ~1% of rows change their last bit; the masked keys of extra blocks
add exact zeros), and a grid row holds at most ``MAX_GRID_ROWS`` query-head rows (oneDNN
switches bf16 matmul kernels above 32 rows). oneDNN's bfloat16 linears are row-independent
too as long as one call has few enough rows (``linear`` bounds them), so a bfloat16 target computes identical logits for a token whether it is
decoded alone, verified in a block or batched with other requests: greedy speculative
decoding then reproduces plain decoding token for token. (Float32 matmuls go through MKL,
whose results depend on the row count by ~1e-6 relative.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Keys are read in whole blocks of this many positions (see the module docstring); KVCache
# storage is a multiple of it.
KV_BLOCK = 64
# Most query-head rows (G * queries) of one grid row's matrices. oneDNN picks another bf16
# matmul kernel above 32 rows, whose last bits differ (measured on AMX, D = 64 and 128), so
# a slot's tokens are split into grid rows of at most MAX_GRID_ROWS // G queries: every query
# then meets the same kernel whether it is decoded, verified or prefilled.
MAX_GRID_ROWS = 32


@dataclass
class VarlenPlan:
    """Layout of one step's tokens, shared by every layer (built by ``plan_varlen``).

    row_slots:   [R] int64 KV cache slot of each grid row: the step's distinct slots, a slot
                 with more than q_block = max(1, MAX_GRID_ROWS // G) tokens taking one row
                 per q_block of them.
    token_index: [T] int64 grid cell ``row * max_q + i`` of each token, or None when every
                 token is its own row in token order (a pure decode step: no scatter).
    max_q:       queries per grid row, min(most tokens of one slot, q_block).
    kv_len:      L = max position + 1 rounded up to a multiple of KV_BLOCK (capped at the
                 cache length), the keys read per row.
    groups:      G = query heads per KV head.
    bias:        [R, 1, G * max_q, L] float32 score bias: 0 where a query sees the key,
                 -inf where the key lies past its position.
    first_slot:  s when row_slots is s, s+1, ..., s+R-1: the rows' keys are then read as a
                 view of the cache, without the gather copy; else None.
    """

    row_slots: torch.Tensor
    token_index: torch.Tensor | None
    max_q: int
    kv_len: int
    groups: int
    bias: torch.Tensor
    first_slot: int | None


def plan_varlen(slots: torch.Tensor, positions: torch.Tensor, groups: int,
                max_len: int | None = None) -> VarlenPlan:
    """Build the step layout.

    Args:
        slots, positions: [T] int64 (T >= 1); no (slot, position) pair twice.
        groups: query heads per KV head (>= 1).
        max_len: the cache's position capacity (caps the padded key length).
    Raises:
        ValueError: empty or mismatched inputs, groups < 1, a position >= max_len.
    """
    if slots.dim() != 1 or slots.shape != positions.shape or slots.numel() == 0:
        raise ValueError(f"slots and positions must be non-empty [T] vectors of one length, got "
                         f"{tuple(slots.shape)} and {tuple(positions.shape)}")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    t = slots.numel()
    device = slots.device
    row_slots, inverse, counts = torch.unique(slots, return_inverse=True, return_counts=True)
    last = int(positions.max())
    kv_len = -(-(last + 1) // KV_BLOCK) * KV_BLOCK
    if max_len is not None:
        if last >= max_len:
            raise ValueError(f"position {last} does not fit a cache of {max_len} positions")
        kv_len = min(kv_len, max_len)
    keys = torch.arange(kv_len, device=device)
    if row_slots.numel() == t:
        # Decode: one token per slot, so the token order is the row order.
        row_slots, token_index, max_q, pos_grid = slots, None, 1, positions
    else:
        order = torch.argsort(inverse, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(inverse)
        rank[order] = torch.arange(t, device=device) - starts[inverse[order]]
        # Splitting long runs (prefill chunks) also bounds the padding of the other rows.
        q_block = max(1, MAX_GRID_ROWS // groups)
        most = int(counts.max())
        max_q = min(most, q_block)
        per_slot = -(-most // q_block)
        row_keys, row = torch.unique(inverse * per_slot + rank // q_block, return_inverse=True)
        row_slots = row_slots[row_keys // per_slot]
        token_index = row * max_q + rank % q_block
        # Padding cells sit at position 0: they see key 0 only, which keeps softmax finite.
        pos_grid = torch.zeros(row_slots.numel() * max_q, dtype=positions.dtype, device=device)
        pos_grid[token_index] = positions
    r = row_slots.numel()
    bias = torch.zeros(r * max_q, kv_len, dtype=torch.float32, device=device)
    bias.masked_fill_(keys > pos_grid[:, None], float("-inf"))
    bias = bias.view(r, 1, 1, max_q, kv_len).expand(r, 1, groups, max_q, kv_len)
    bias = bias.reshape(r, 1, groups * max_q, kv_len)
    first = int(row_slots[0])
    if r > 1 and not bool((row_slots == torch.arange(first, first + r, device=device)).all()):
        first = None
    return VarlenPlan(row_slots, token_index, max_q, kv_len, groups, bias, first)


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                     *, scale: float | None = None, plan: VarlenPlan | None = None) -> torch.Tensor:
    """Causal attention of flat tokens over their slots' cached keys.

    Query head h uses KV head h // G (transformers' ``repeat_kv`` convention).

    Args:
        q: [T, Hq, D] queries (after RoPE), any float dtype.
        k_cache, v_cache: [num_slots, Hkv, max_len, D] one layer's cache (``KVCache.k[l]``);
            must already hold this step's keys/values, positions 0..positions[t] of
            slots[t] must all be written, and every entry must be finite (a hidden key still
            multiplies a zero probability).
        slots, positions: [T] int64 marker of each token; ignored when ``plan`` is given.
        scale: softmax scale; None = D ** -0.5.
        plan: ``plan_varlen(slots, positions, Hq // Hkv, max_len)``, to share across layers.
    Returns:
        [T, Hq, D] attention outputs in q's dtype.
    Raises:
        ValueError: inconsistent head counts or dims, or neither plan nor markers given.
    """
    t, hq, d = q.shape
    _, hkv, max_len, dk = k_cache.shape
    if dk != d or v_cache.shape != k_cache.shape or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} (needs equal head_dim, Hq divisible by Hkv)")
    if plan is None:
        if slots is None or positions is None:
            raise ValueError("varlen_attention needs slots and positions, or a plan")
        plan = plan_varlen(slots, positions, hq // hkv, max_len)
    g, mq, length = plan.groups, plan.max_q, plan.kv_len
    if g * hkv != hq or length > max_len:
        raise ValueError(f"plan (groups={g}, kv_len={length}) does not fit q/caches")
    r = plan.row_slots.numel()
    if plan.first_slot is not None:
        s = plan.first_slot
        k, v = k_cache[s:s + r, :, :length], v_cache[s:s + r, :, :length]
    else:
        k = k_cache[:, :, :length].index_select(0, plan.row_slots)
        v = v_cache[:, :, :length].index_select(0, plan.row_slots)
    if plan.token_index is None:
        grid = q.view(r, hkv, g, d)
    else:
        grid = q.new_zeros(r * mq, hq, d)
        grid[plan.token_index] = q
        grid = grid.view(r, mq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(r, hkv, g * mq, d)
    scores = torch.matmul(grid, k.to(q.dtype).transpose(-1, -2))
    # One op scales, masks and promotes the scores to float32 for the softmax.
    scores = torch.add(plan.bias, scores, alpha=d ** -0.5 if scale is None else scale)
    out = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v.to(q.dtype))
    if plan.token_index is None:
        return out.reshape(t, hq, d)
    out = out.view(r, hkv, g, mq, d).permute(0, 3, 1, 2, 4).reshape(r * mq, hq, d)
    return out[plan.token_index]
