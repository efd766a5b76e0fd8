"""Pure-torch stand-in for the CPU build of ``sgl_kernel`` (test harness only).

PyPI's ``sglang-kernel`` wheel ships CUDA ops only, and ``import sgl_kernel`` raises without
libcuda. With ``SGLANG_USE_CPU_ENGINE=1``, sglang 0.5.23 imports these CPU ops at module level
(``kernels/ops/kvcache/cache_move.py``, ``srt/mem_cache/allocation.py``,
``kernels/ops/speculative/{cache_locs,eagle,spec_tree}.py``). This directory goes first on the
server's PYTHONPATH so it shadows the installed wheel; nothing is installed.

It registers no ``torch.ops.sgl_kernel`` op (``convert_weight_packed`` in particular), so
sglang's ``cpu_has_amx_support()`` is False and every layer takes its torch path.
Each op mirrors the Triton kernel of the same name (argument order of the CPU call site).
"""
import ctypes

import torch

__version__ = "0.0.0+dspark-cpu-harness"


def _rows(start_offset: torch.Tensor, end_offset: torch.Tensor):
    """(row, start, end, packed offset) per request: requests are packed back to back."""
    offset = 0
    for row, (start, end) in enumerate(zip(start_offset.tolist(), end_offset.tolist())):
        yield row, start, end, offset
        offset += max(end - start, 0)


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """req_to_token[req, start:end] = the request's packed slice of ``out_cache_loc``."""
    pools = req_pool_indices.tolist()
    for row, start, end, offset in _rows(start_offset, end_offset):
        if end > start:
            req_to_token[pools[row], start:end] = out_cache_loc[offset:offset + end - start]


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """The inverse gather: packed ``out_cache_loc`` = req_to_token[req, start:end] per request."""
    pools = req_pool_indices.tolist()
    for row, start, end, offset in _rows(start_offset, end_offset):
        if end > start:
            out_cache_loc[offset:offset + end - start] = req_to_token[pools[row], start:end]


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens,
                                           out_cache_loc, pool_len, topk, num_cols):
    """Request i's ``topk * num_cols`` slots from its ``seq_lens`` on, packed per request."""
    width = topk * num_cols
    for i, (pool, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * width:(i + 1) * width] = req_to_token[pool, start:start + width]


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """Copy token rows ``src_loc`` -> ``tgt_loc`` in every layer buffer (raw pointers, row
    strides in bytes). All sources are read before any target is written, as the kernel's
    one-load-per-program does."""
    pairs = [(t, s) for t, s in zip(tgt_loc.tolist(), src_loc.tolist()) if t != s]
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * stride, stride) for _, s in pairs]
        for (t, _), row in zip(pairs, rows):
            ctypes.memmove(base + t * stride, row, stride)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus_tokens[i] = accept_tokens.flat[i * accept_stride + accept_lens[i] - 1]."""
    index = (torch.arange(accept_lens.numel(), device=accept_lens.device) * accept_stride
             + accept_lens.long() - 1)
    bonus_tokens.copy_(accept_tokens.reshape(-1)[index])


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Pack ``out_cache_loc`` at the accepted (non -1) entries of ``accept_index``, in order."""
    accepted = accept_index.reshape(-1)
    accepted = accepted[accepted > -1].long()
    accept_out_cache_loc[:accepted.numel()] = out_cache_loc[accepted]


def _tree_only(name):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{name}: tree speculation (EAGLE topk > 1) is not in the "
                                  f"dspark CPU harness's sgl_kernel stand-in")

    refuse.__name__ = name
    return refuse


# Imported at module level by spec_tree.py on CPU; only tree-shaped (EAGLE) drafts call them.
build_tree_kernel_efficient_cpu = _tree_only("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _tree_only("verify_tree_greedy_cpu")
