"""Variable-length verify attention over a paged KV cache (paper Section 5.3): the CUDA
kernel ``dspark::varlen_attention`` and its PyTorch reference, which is also the CPU engine's
attention.

The T query tokens of all requests in a step arrive flat, in any order, each with a marker
(slot, position): a decode token, a verify block of l_r + 1 tokens, or a prefill chunk. Token
t attends causally to keys 0..position of its slot, so nothing is padded to a common length.
The cache is paged: ``k_cache[page, i]`` holds the key of position ``j * page_size + i`` of
every slot whose ``page_table[slot, j] == page``; it must already hold the step's own keys.
Query head h reads KV head h // G, G = Hq / Hkv (grouped-query attention, transformers'
``repeat_kv`` convention). The engine's ``KVCache`` is such a cache: a pool of KV_BLOCK-sized
pages, or one page per slot for the offline tools (``KVCache.paged``).

The reference lays one step out on a grid (``plan_varlen``, once for all layers): the step's
distinct slots become rows of a [R, Hkv, G * max_q, D] query grid against [R, Hkv, L, D] keys
(L = max position + 1, rounded up to ``KV_BLOCK``), so grouped-query attention never repeats
K/V, and two matmuls in the model dtype with a float32 softmax (the arithmetic of
transformers' eager attention) compute it. Why not ``F.scaled_dot_product_attention``: on CPU
its result for one query depends on how many other queries share the call (measured: bf16
outputs differ between a decode token and the same token inside a verify block, up to 0.4 in
the final logits). The matmul + softmax form gives every query row the same bits whatever
the step's composition (measured in bfloat16 on AVX512-BF16 and AMX, 1 and 2 threads), under
two conditions the plan enforces: L is padded to a multiple of ``KV_BLOCK`` (unpadded, the
probs @ V reduction is blocked differently and ~1% of rows change their last bit; masked keys
add exact zeros), and a grid row holds at most ``MAX_GRID_ROWS`` query-head rows (oneDNN
switches bf16 matmul kernels above 32 rows). With oneDNN's row-independent bf16 linears
(``dspark_serve.model.linear``), a bf16 target then computes identical logits for a token
whether it is decoded alone, verified in a block or batched with other requests, and greedy
speculative decoding reproduces plain decoding token for token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_serve.ops.cpu_features import native_bf16_cpu
from dspark_serve.ops.extension import capturing, use_cuda_kernel

# Keys are read in whole blocks of this many positions (see the module docstring); KVCache
# storage is a multiple of it.
KV_BLOCK = 64
# Most query-head rows (G * queries) of one grid row's matrices: oneDNN picks another bf16
# matmul kernel above 32 rows, whose last bits differ (measured on AMX, D = 64 and 128), so a
# slot's tokens are split into grid rows of at most MAX_GRID_ROWS // G queries and every
# query meets the same kernel whether it is decoded, verified or prefilled.
MAX_GRID_ROWS = 32
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_KERNEL_HEAD_DIMS = (64, 128)
_KERNEL_MAX_GROUP = 64
_MAX_SPLITS = 64


@dataclass
class VarlenPlan:
    """Layout of one step's tokens on the reference's grid, shared by every layer.

    row_slots:   [R] int64 slot of each grid row: the step's distinct slots, a slot with more
                 than q_block = max(1, MAX_GRID_ROWS // G) tokens taking one row per q_block.
    row_pages:   [R, P] int64 the pages holding each row's keys 0..kv_len-1; pages past
                 the row's last position repeat the row's first page, so a row reads only
                 its own slot's pages (their keys meet a zero probability).
    token_index: [T] int64 grid cell ``row * max_q + i`` of each token, or None when every
                 token is its own row in token order (a pure decode step: no scatter).
    max_q:       queries per grid row, min(most tokens of one slot, q_block).
    kv_len:      L = max position + 1 rounded up to a multiple of KV_BLOCK (capped at the
                 page table's capacity), the keys read per row.
    groups:      G = query heads per KV head.
    bias:        [R, 1, G * max_q, L] float32 score bias: 0 where a query sees the key, -inf
                 where the key lies past its position.
    first_page:  p when P == 1 and row_pages is p, p+1, ..., p+R-1: the keys are then a view
                 of the cache, without a gather copy; else None.
    num_tokens:  T.
    """

    row_slots: torch.Tensor
    row_pages: torch.Tensor
    token_index: torch.Tensor | None
    max_q: int
    kv_len: int
    groups: int
    bias: torch.Tensor
    first_page: int | None
    num_tokens: int


def plan_varlen(marker: torch.Tensor, groups: int, k_cache: torch.Tensor,
                page_table: torch.Tensor) -> VarlenPlan:
    """Build a step's layout for ``varlen_attention_reference``.

    Args:
        marker: [T, 2] int32/int64 (slot, position) per token, T >= 1; no pair twice.
        groups: query heads per KV head (>= 1).
        k_cache: [num_pages, page_size, Hkv, D], read for its shape only.
        page_table: [num_slots, max_pages] int32/int64.
    Raises:
        ValueError: empty or malformed marker, groups < 1, markers or needed page ids
            outside the cache.
    """
    if marker.dim() != 2 or marker.shape[1] != 2 or marker.shape[0] == 0 or \
            marker.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"marker must be a non-empty int32/int64 [T, 2], got {marker.dtype} "
                         f"{tuple(marker.shape)}")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    _check_values(marker, k_cache, page_table)
    page_size = k_cache.shape[1]
    slots, positions = marker[:, 0].long(), marker[:, 1].long()
    t = slots.numel()
    device = slots.device
    row_slots, inverse, counts = torch.unique(slots, return_inverse=True, return_counts=True)
    kv_len = min(-(-(int(positions.max()) + 1) // KV_BLOCK) * KV_BLOCK,
                 page_table.shape[1] * page_size)
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
    n_pages = -(-kv_len // page_size)
    row_pages = page_table[row_slots, :n_pages].long()
    first_page = None
    if n_pages == 1:
        first = int(row_pages[0, 0])
        if bool((row_pages[:, 0] == torch.arange(first, first + r, device=device)).all()):
            first_page = first
    else:
        # The table may not name pages past a row's last position (or name another
        # request's): read the row's own first page there instead.
        row_last = pos_grid.view(r, max_q).amax(dim=1)
        needed = torch.arange(n_pages, device=device) <= (row_last // page_size)[:, None]
        row_pages = torch.where(needed, row_pages, row_pages[:, :1])
    return VarlenPlan(row_slots, row_pages, token_index, max_q, kv_len, groups, bias,
                      first_page, t)


def varlen_attention(q: torch.Tensor, marker: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, page_table: torch.Tensor, *,
                     scale: float | None = None, num_splits: int = 0,
                     validate: bool = True, plan: VarlenPlan | None = None) -> torch.Tensor:
    """Causal attention of flat tokens over their slots' paged keys.

    Uses the CUDA kernel when ``varlen_kernel_applies`` (fp16/bf16 CUDA tensors, head dim 64
    or 128, GQA groups up to 64, cache strides divisible by 8, extension built); otherwise
    ``varlen_attention_reference``.

    Args:
        q: [T, Hq, D] queries (after RoPE).
        marker: [T, 2] int32/int64 (slot, position) per token.
        k_cache, v_cache: [num_pages, page_size, Hkv, D], q's dtype; last dim contiguous,
            other strides free (``KVCache.paged`` passes a permuted view).
        page_table: [num_slots, max_pages] int32/int64 page ids per slot.
        scale: softmax scale; None = D ** -0.5.
        num_splits: CUDA only: KV splits per query tile, 0 = chosen from the shapes and the
            SM count, else 1..64.
        validate: CUDA only: check marker and page ids against the cache (a host sync;
            skipped during CUDA graph capture). The reference always checks them, once per
            plan.
        plan: reference only: ``plan_varlen`` of this step, shared across layers.

    Returns:
        [T, Hq, D] in q's dtype; every element written.

    Raises:
        ValueError: inconsistent shapes, dtypes or devices, or markers or page ids outside
            the cache.
    """
    _check_shapes(q, marker, k_cache, v_cache, page_table)
    if not 0 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [0, {_MAX_SPLITS}], got {num_splits}")
    if not (use_cuda_kernel(marker, page_table) and varlen_kernel_applies(q, k_cache, v_cache)):
        return _attend(q, marker, k_cache, v_cache, page_table, plan, scale)
    if validate and not capturing():
        _check_values(marker, k_cache, page_table)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    q = q.contiguous()
    if q.data_ptr() % 16:
        q = q.clone()       # a contiguous view at an odd offset: the kernel loads 16 bytes
    if q.shape[0]:
        torch.ops.dspark.varlen_attention(
            q, marker.to(torch.int32).contiguous(), k_cache, v_cache,
            page_table.to(torch.int32).contiguous(), out,
            float(q.shape[2] ** -0.5 if scale is None else scale), num_splits)
    return out


def varlen_kernel_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``varlen_attention`` runs the CUDA kernel for these tensors (shapes as there;
    q may be any tensor of the queries' shape, dtype and device): callers then skip
    ``plan_varlen``."""
    hq, d, hkv = q.shape[1], q.shape[2], k_cache.shape[2]
    return (use_cuda_kernel(q, k_cache, v_cache) and q.dtype in _KERNEL_DTYPES
            and d in _KERNEL_HEAD_DIMS and 0 < hq // hkv <= _KERNEL_MAX_GROUP
            and all(c.stride(3) == 1 and all(s % 8 == 0 for s in c.stride()[:3])
                    and c.data_ptr() % 16 == 0 for c in (k_cache, v_cache)))


def varlen_attention_reference(q: torch.Tensor, marker: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, page_table: torch.Tensor, *,
                               scale: float | None = None,
                               plan: VarlenPlan | None = None) -> torch.Tensor:
    """PyTorch reference of ``varlen_attention`` (same arguments) and the CPU engine's
    attention: the step's tokens laid out on ``plan``'s grid, two matmuls in q's dtype and a
    float32 softmax (see the module docstring for why this form).

    Unlike the kernel, it reads the whole KV_BLOCK-padded key range, always from the row's
    own pages (``VarlenPlan.row_pages``): entries past a row's last position meet a zero
    probability and must be finite (``KVCache`` zero-fills and only ever writes the model's
    keys and values), since 0 * NaN would poison the row.

    Args:
        plan: ``plan_varlen(marker, Hq // Hkv, k_cache, page_table)``, to share one step's
            bookkeeping across layers (then marker values are not checked again); None =
            built here.
    Raises:
        ValueError: as ``varlen_attention``, or a plan that does not fit q and the caches.
    """
    _check_shapes(q, marker, k_cache, v_cache, page_table)
    return _attend(q, marker, k_cache, v_cache, page_table, plan, scale)


def _attend(q: torch.Tensor, marker: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            page_table: torch.Tensor, plan: VarlenPlan | None,
            scale: float | None) -> torch.Tensor:
    """The reference after the shape checks (so the dispatcher does them once)."""
    t, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if t == 0:
        return q.new_empty(q.shape)
    if plan is None:
        plan = plan_varlen(marker, hq // hkv, k_cache, page_table)
    g, mq, length = plan.groups, plan.max_q, plan.kv_len
    r, n_pages = plan.row_pages.shape
    if g * hkv != hq or n_pages * page_size < length or t != plan.num_tokens:
        raise ValueError(f"plan (tokens={plan.num_tokens}, groups={g}, kv_len={length}) does "
                         f"not fit q {tuple(q.shape)} / caches {tuple(k_cache.shape)}")
    k, v = _row_keys(k_cache, plan), _row_keys(v_cache, plan)
    if plan.token_index is None:
        grid = q.view(r, hkv, g, d)
    else:
        grid = q.new_zeros(r * mq, hq, d)
        grid[plan.token_index] = q
        grid = grid.view(r, mq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(r, hkv, g * mq, d)
    dt = _matmul_dtype(q)
    scores = torch.matmul(grid.to(dt), k.to(dt).transpose(-1, -2))
    # One op scales, masks and promotes the scores to float32 for the softmax.
    scores = torch.add(plan.bias, scores, alpha=d ** -0.5 if scale is None else scale)
    out = torch.matmul(torch.softmax(scores, dim=-1).to(dt), v.to(dt)).to(q.dtype)
    if plan.token_index is None:
        return out.reshape(t, hq, d)
    out = out.view(r, hkv, g, mq, d).permute(0, 3, 1, 2, 4).reshape(r * mq, hq, d)
    return out[plan.token_index]


def _matmul_dtype(q: torch.Tensor) -> torch.dtype:
    """q's dtype, except bfloat16 on a CPU without bfloat16 dot products: there a query row's
    bits depend on the rows beside it in bfloat16 and in float32 matmuls alike (oneDNN's
    emulated bfloat16, MKL's float32 blocking; measured on an AVX512-VNNI-only Xeon), so the
    products run in float64, whose last-bit differences never reach the float32 softmax or
    the bfloat16 output (the batch-invariance tests pass). The int4 path has its own kernel."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and not native_bf16_cpu():
        return torch.float64
    return q.dtype


def _row_keys(cache: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
    """[R, Hkv, kv_len, D] keys (or values) of the plan's grid rows. Read in the
    [pages, Hkv, page_size, D] orientation, ``KVCache``'s storage order: a consecutive run of
    single pages is a view, and a gather copies exactly those keys into a contiguous
    [R, Hkv, kv_len, D] (the batch invariance depends on these strides)."""
    heads_first = cache.transpose(1, 2)
    length = plan.kv_len
    r, n_pages = plan.row_pages.shape
    if n_pages == 1:
        if plan.first_page is not None:
            p = plan.first_page
            return heads_first[p:p + r, :, :length]
        return heads_first[:, :, :length].index_select(0, plan.row_pages[:, 0])
    _, hkv, page_size, d = heads_first.shape
    # One index_select of (page, head) blocks in [R, Hkv, P] order lands the keys in their
    # final [R, Hkv, P * page_size, D] layout (the reshape is a view of KVCache's storage).
    blocks = plan.row_pages[:, None, :] * hkv + torch.arange(hkv, device=cache.device)[:, None]
    keys = heads_first.reshape(-1, page_size, d).index_select(0, blocks.reshape(-1))
    return keys.view(r, hkv, -1, d)[:, :, :length]


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
