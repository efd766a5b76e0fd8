"""TARGET_VERIFY for sglang's ``TorchNativeAttnBackend`` (written against sglang 0.5.23).

Its ``forward_extend`` reads ``forward_batch.extend_prefix_lens``, which a verify batch does not
set (``layers/attention/torch_native_backend.py``: ``_run_sdpa_forward_extend``). A verify
forward attends each request's verify window (per-request lengths in compact mode, from the
``RaggedVerifyLayout``; gamma + 1 each in static mode) to its whole prefix plus the window's
earlier tokens: causal for the target, bidirectional for an encoder-only drafter. Chains only:
tree drafts (a custom mask) are refused.
"""
from __future__ import annotations

import torch
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.speculative.ragged_verify import resolve_ragged_verify_layout
from torch.nn.functional import scaled_dot_product_attention


def verify_lens(forward_batch, num_tokens: int) -> list[int]:
    """Verify tokens per request: the ragged layout's lengths, else ``num_tokens`` split
    evenly (static mode)."""
    layout = resolve_ragged_verify_layout(forward_batch)
    if layout is not None:
        if layout.verify_lens_cpu is not None:
            return list(layout.verify_lens_cpu)
        return layout.verify_lens.tolist()
    batch_size = int(forward_batch.batch_size)
    if num_tokens % batch_size:
        raise ValueError(f"static verify: {num_tokens} tokens do not split over "
                         f"{batch_size} requests")
    return [num_tokens // batch_size] * batch_size


def forward_target_verify(backend, q, k, v, layer, forward_batch, save_kv_cache=True):
    """``forward_extend`` of a TARGET_VERIFY batch: [tokens, H * Dv] attention output; rows
    past the layout's verify tokens (graph padding) stay zero."""
    if getattr(forward_batch.spec_info, "custom_mask", None) is not None:
        raise NotImplementedError("CPU harness verify attention handles chain drafts only")
    cache_loc = forward_batch.out_cache_loc
    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(cache_loc, backend.swa_out_cache_loc), k, v)
    heads, head_dim, v_dim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
    query = q.reshape(-1, heads, head_dim)
    out = q.new_zeros((query.shape[0], heads * v_dim))
    out_heads = out.view(-1, heads, v_dim)
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    causal = not (layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY)
    prefix_lens = forward_batch.seq_lens.tolist()
    pools = forward_batch.req_pool_indices.tolist()
    start = 0
    for pool, prefix, n in zip(pools, prefix_lens, verify_lens(forward_batch, query.shape[0])):
        if n == 0:
            continue
        slots = torch.cat([req_to_token[pool, :prefix].long(), cache_loc[start:start + n].long()])
        keys = k_cache[slots].movedim(0, 1).to(query.dtype)        # [Hkv, prefix + n, D]
        values = v_cache[slots].movedim(0, 1).to(query.dtype)
        mask = None
        if causal:      # window token i sees the prefix and window tokens 0..i
            positions = torch.arange(prefix + n, device=q.device)
            mask = positions[None, :] <= prefix + torch.arange(n, device=q.device)[:, None]
        attended = scaled_dot_product_attention(
            query[start:start + n].movedim(0, 1).unsqueeze(0), keys.unsqueeze(0),
            values.unsqueeze(0), attn_mask=mask, scale=layer.scaling,
            enable_gqa=heads != layer.tp_k_head_num)
        out_heads[start:start + n] = attended.squeeze(0).movedim(1, 0)
        start += n
    return out
