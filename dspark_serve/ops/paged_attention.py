"""Variable-length verify attention over a paged KV cache (paper Section 5.3): the CUDA
kernel ``dspark::varlen_attention`` and its PyTorch reference.

The T query tokens of all requests in a step arrive flat, each with a marker (slot,
position); token t attends causally to keys 0..position of its slot, so a request's verify
block of l_r + 1 tokens costs l_r + 1 rows and nothing is padded to a common length. The
cache is paged: ``k_cache[page, i]`` holds the key of token ``page_table[slot, j] ==
page``'s i-th entry, i.e. position ``j * page_size + i`` of that slot. The cache must already
hold the step's own keys. Query head h reads KV head h // (Hq / Hkv) (grouped-query
attention). ``dspark_serve.engine.attention`` is the same attention over a contiguous
per-slot cache.
"""
from __future__ import annotations

import torch

from dspark_serve.ops.extension import capturing, use_cuda_kernel

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_KERNEL_HEAD_DIMS = (64, 128)
_KERNEL_MAX_GROUP = 64
_MAX_SPLITS = 64


def varlen_attention(q: torch.Tensor, marker: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, page_table: torch.Tensor, *,
                     scale: float | None = None, num_splits: int = 0,
                     validate: bool = True) -> torch.Tensor:
    """Causal attention of flat tokens over their slots' paged keys.

    Uses the CUDA kernel for fp16/bf16 CUDA tensors with head dim 64 or 128 (GQA groups up
    to 64, cache strides divisible by 8) when the extension is built; otherwise
    ``varlen_attention_reference``.

    Args:
        q: [T, Hq, D] queries (after RoPE).
        marker: [T, 2] int32/int64 (slot, position) per token.
        k_cache, v_cache: [num_pages, page_size, Hkv, D], q's dtype; last dim contiguous.
        page_table: [num_slots, max_pages] int32/int64 page ids per slot.
        scale: softmax scale; None = D ** -0.5.
        num_splits: CUDA only: KV splits per query tile, 0 = chosen from the shapes and the
            SM count, else 1..64.
        validate: check marker and page ids against the cache (a host sync; skipped
            during CUDA graph capture).

    Returns:
        [T, Hq, D] in q's dtype; every element written.

    Raises:
        ValueError: inconsistent shapes, dtypes or devices, or (validate) markers or
            page ids outside the cache.
    """
    _check_shapes(q, marker, k_cache, v_cache, page_table)
    if not 0 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [0, {_MAX_SPLITS}], got {num_splits}")
    if not (use_cuda_kernel(q, marker, k_cache, v_cache, page_table)
            and _kernel_fits(q, k_cache, v_cache)):
        return varlen_attention_reference(q, marker, k_cache, v_cache, page_table, scale=scale)
    if validate and not capturing():
        _check_values(marker, k_cache, page_table)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0]:
        torch.ops.dspark.varlen_attention(
            q.contiguous(), marker.to(torch.int32).contiguous(), k_cache, v_cache,
            page_table.to(torch.int32).contiguous(), out,
            float(q.shape[2] ** -0.5 if scale is None else scale), num_splits)
    return out


def varlen_attention_reference(q: torch.Tensor, marker: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, page_table: torch.Tensor, *,
                               scale: float | None = None) -> torch.Tensor:
    """PyTorch reference of ``varlen_attention`` (same arguments): per distinct slot, gather
    its pages and apply a masked softmax in float32. Always validates values."""
    _check_shapes(q, marker, k_cache, v_cache, page_table)
    _check_values(marker, k_cache, page_table)
    t, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    slots, positions = marker[:, 0].long(), marker[:, 1].long()
    out = torch.empty((t, hq, d), dtype=torch.float32, device=q.device)
    for slot in torch.unique(slots).tolist():
        idx = (slots == slot).nonzero().squeeze(1)
        pos = positions[idx]
        length = int(pos.max()) + 1
        pages = page_table[slot, :-(-length // page_size)].long()
        k = k_cache[pages].reshape(-1, hkv, d)[:length].float()            # [L, Hkv, D]
        v = v_cache[pages].reshape(-1, hkv, d)[:length].float()
        qs = q[idx].float().view(-1, hkv, g, d)
        scores = torch.einsum("nkgd,lkd->nkgl", qs, k) * scale
        visible = torch.arange(length, device=q.device) <= pos[:, None]      # [n, L]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        out[idx] = torch.einsum("nkgl,lkd->nkgd", scores.softmax(dim=-1), v).reshape(-1, hq, d)
    return out.to(q.dtype)


def _kernel_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    hq, d, hkv = q.shape[1], q.shape[2], k_cache.shape[2]
    return (q.dtype in _KERNEL_DTYPES and d in _KERNEL_HEAD_DIMS and hq // hkv <= _KERNEL_MAX_GROUP
            and all(c.stride(3) == 1 and all(s % 8 == 0 for s in c.stride()[:3])
                    and c.data_ptr() % 16 == 0 for c in (k_cache, v_cache)))


def _check_shapes(q, marker, k_cache, v_cache, page_table) -> None:
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q must be floating [T, Hq, D], got {q.dtype} {tuple(q.shape)}")
    t, hq, d = q.shape
    if k_cache.dim() != 4 or k_cache.shape[3] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_pages, page_size, Hkv, D={d}], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"caches must have q's dtype {q.dtype}, got "
                         f"{k_cache.dtype}/{v_cache.dtype}")
    hkv = k_cache.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    int_types = (torch.int32, torch.int64)
    if marker.shape != (t, 2) or marker.dtype not in int_types:
        raise ValueError(f"marker must be int32/int64 [{t}, 2], got {marker.dtype} "
                         f"{tuple(marker.shape)}")
    if page_table.dim() != 2 or page_table.dtype not in int_types:
        raise ValueError(f"page_table must be int32/int64 [num_slots, max_pages], got "
                         f"{page_table.dtype} {tuple(page_table.shape)}")
    devices = {x.device for x in (q, marker, k_cache, v_cache, page_table)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_values(marker: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor) -> None:
    if marker.shape[0] == 0:
        return
    num_pages, page_size = k_cache.shape[:2]
    num_slots, max_pages = page_table.shape
    slots, positions = marker[:, 0].long(), marker[:, 1].long()
    bad_slot = ((slots < 0) | (slots >= num_slots)).any()
    bad_pos = ((positions < 0) | (positions >= max_pages * page_size)).any()
    if bool(bad_slot | bad_pos):
        raise ValueError(f"markers must have slot in [0, {num_slots}) and position in "
                         f"[0, {max_pages * page_size})")
    used = page_table[slots.clamp(0, num_slots - 1)]                          # [T, max_pages]
    needed = torch.arange(max_pages, device=marker.device) <= (positions // page_size)[:, None]
    if bool((((used < 0) | (used >= num_pages)) & needed).any()):
        raise ValueError(f"page_table entries read by the markers must be in [0, {num_pages})")
