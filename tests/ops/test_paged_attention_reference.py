"""varlen_attention_reference (paged cache, flat tokens with (slot, position) markers)
against a per-token loop, torch SDPA per request, and the engine's contiguous-cache path."""
import math

import pytest
import torch
import torch.nn.functional as F

from dspark_serve.ops import varlen_attention, varlen_attention_reference

# (slot, context length, query tokens at the end of the context) per request: a long
# context, a single-token decode, a prefill-like block.
REQUESTS = [(3, 23, 4), (0, 1, 1), (5, 9, 9), (1, 40, 2)]


def _paged_case(hq=6, hkv=2, d=32, page_size=4, dtype=torch.float32, seed=0, num_slots=6):
    g = torch.Generator().manual_seed(seed)
    max_pages = max(math.ceil(length / page_size) for _, length, _ in REQUESTS) + 1
    num_pages = sum(math.ceil(length / page_size) for _, length, _ in REQUESTS) + 3
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    page_table = torch.full((num_slots, max_pages), -1, dtype=torch.int32)
    free = torch.randperm(num_pages, generator=g).tolist()
    markers = []
    for slot, length, n_q in REQUESTS:
        for j in range(math.ceil(length / page_size)):
            page_table[slot, j] = free.pop()
        markers += [(slot, pos) for pos in range(length - n_q, length)]
    order = torch.randperm(len(markers), generator=g)  # tokens of requests interleaved
    marker = torch.tensor(markers, dtype=torch.int32)[order]
    q = torch.randn(len(markers), hq, d, generator=g).to(dtype)
    return q, marker, k_cache, v_cache, page_table


def _per_token(q, marker, k_cache, v_cache, page_table):
    t, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(t, hq, d)
    for i in range(t):
        slot, pos = marker[i].tolist()
        rows = [(int(page_table[slot, j // page_size]), j % page_size) for j in range(pos + 1)]
        k = torch.stack([k_cache[p, o] for p, o in rows]).float()  # [pos + 1, Hkv, D]
        v = torch.stack([v_cache[p, o] for p, o in rows]).float()
        for h in range(hq):
            kv = h // (hq // hkv)
            w = torch.softmax(k[:, kv] @ q[i, h].float() / math.sqrt(d), dim=0)
            out[i, h] = w @ v[:, kv]
    return out


def _contiguous(k_cache, page_table, num_slots, max_len):
    """[num_slots, Hkv, max_len, D] copy of the paged cache (the engine's layout)."""
    page_size, hkv, d = k_cache.shape[1:]
    out = torch.zeros(num_slots, hkv, max_len, d, dtype=k_cache.dtype)
    for slot in range(num_slots):
        for j in range(max_len):
            page = int(page_table[slot, j // page_size])
            if page >= 0:
                out[slot, :, j] = k_cache[page, j % page_size]
    return out


@pytest.mark.parametrize("hq,hkv,d,page_size", [(6, 2, 32, 4), (4, 4, 16, 1), (8, 1, 64, 16)])
def test_reference_matches_per_token_loop(hq, hkv, d, page_size):
    case = _paged_case(hq=hq, hkv=hkv, d=d, page_size=page_size)
    torch.testing.assert_close(varlen_attention_reference(*case), _per_token(*case),
                               rtol=1e-5, atol=1e-5)


def test_reference_matches_sdpa_per_request():
    q, marker, k_cache, v_cache, page_table = _paged_case(hq=6, hkv=2, d=32, page_size=4, seed=1)
    out = varlen_attention_reference(q, marker, k_cache, v_cache, page_table)
    k_all = _contiguous(k_cache, page_table, 6, 40)
    v_all = _contiguous(v_cache, page_table, 6, 40)
    for slot, length, n_q in REQUESTS:
        idx = torch.nonzero(marker[:, 0] == slot).squeeze(1)
        pos = marker[idx, 1].long()
        k = k_all[slot, :, :length].repeat_interleave(3, dim=0)[None]      # [1, Hq, L, D]
        v = v_all[slot, :, :length].repeat_interleave(3, dim=0)[None]
        mask = torch.arange(length) <= pos[:, None]
        expected = F.scaled_dot_product_attention(q[idx].transpose(0, 1)[None], k, v,
                                                  attn_mask=mask)
        torch.testing.assert_close(out[idx], expected[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_reference_matches_engine_contiguous_attention():
    engine_attention = pytest.importorskip("dspark_serve.engine.attention")
    q, marker, k_cache, v_cache, page_table = _paged_case(hq=6, hkv=2, d=32, page_size=4, seed=2)
    out = varlen_attention_reference(q, marker, k_cache, v_cache, page_table)
    expected = engine_attention.varlen_attention(
        q, _contiguous(k_cache, page_table, 6, 40), _contiguous(v_cache, page_table, 6, 40),
        marker[:, 0].long(), marker[:, 1].long())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bf16_within_tolerance_of_fp32():
    case32 = _paged_case(hq=8, hkv=2, d=64, page_size=16, seed=3)
    q, marker, k_cache, v_cache, page_table = case32
    out16 = varlen_attention_reference(q.bfloat16(), marker, k_cache.bfloat16(), v_cache.bfloat16(),
                                       page_table)
    assert out16.dtype == torch.bfloat16
    assert (out16.float() - varlen_attention_reference(*case32)).abs().max() < 2e-2


def test_dispatcher_on_cpu_and_scale():
    case = _paged_case(seed=4)
    torch.testing.assert_close(varlen_attention(*case, scale=0.3),
                               varlen_attention_reference(*case, scale=0.3))
    assert not torch.allclose(varlen_attention(*case, scale=0.3), varlen_attention(*case))


def test_bad_inputs():
    q, marker, k_cache, v_cache, page_table = _paged_case()
    bad = marker.clone()
    bad[0, 0] = 6
    with pytest.raises(ValueError, match="slot in"):
        varlen_attention(q, bad, k_cache, v_cache, page_table)
    bad = marker.clone()
    bad[0, 1] = page_table.shape[1] * 4
    with pytest.raises(ValueError, match="position in"):
        varlen_attention(q, bad, k_cache, v_cache, page_table)
    bad = marker.clone()
    bad[0] = torch.tensor([2, 0], dtype=torch.int32)  # slot 2 has no pages
    with pytest.raises(ValueError, match="page_table entries"):
        varlen_attention(q, bad, k_cache, v_cache, page_table)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        varlen_attention(q[:, :5], marker, k_cache, v_cache, page_table)
    with pytest.raises(ValueError, match="marker must be"):
        varlen_attention(q, marker.float(), k_cache, v_cache, page_table)
    with pytest.raises(ValueError, match="num_splits"):
        varlen_attention(q, marker, k_cache, v_cache, page_table, num_splits=65)


def test_engine_cache_layout_as_one_page_per_slot():
    # The engine's contiguous [num_slots, Hkv, max_len, D] cache is a paged cache with
    # page_size = max_len once permuted to [num_slots, max_len, Hkv, D] (strides allowed).
    engine_attention = pytest.importorskip("dspark_serve.engine.attention")
    g = torch.Generator().manual_seed(5)
    k = torch.randn(4, 2, 30, 16, generator=g)
    v = torch.randn(4, 2, 30, 16, generator=g)
    slots = torch.tensor([2, 0, 2, 3, 2])
    positions = torch.tensor([7, 0, 8, 29, 9])
    q = torch.randn(5, 6, 16, generator=g)
    out = varlen_attention(q, torch.stack([slots, positions], dim=1), k.permute(0, 2, 1, 3),
                           v.permute(0, 2, 1, 3), torch.arange(4)[:, None])
    expected = engine_attention.varlen_attention(q, k, v, slots, positions)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
