"""varlen_attention_reference (paged cache, flat tokens with (slot, position) markers): against
a per-token loop and torch SDPA, on multi-page tables and on the engine's one page per slot
(KVCache.paged), its step plans, and the bf16 batch invariance greedy speculation relies on."""
import math

import pytest
import torch
import torch.nn.functional as F

from dspark_serve.model.kv_cache import KVCache
from dspark_serve.ops import varlen_attention, varlen_attention_reference
from dspark_serve.ops.paged_attention import KV_BLOCK, plan_varlen

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


def test_pages_past_a_rows_last_position_are_never_read():
    """Unnamed pages (-1) past a slot's last position and NaN in them do not reach the output:
    the padded key length (KV_BLOCK) spans pages the table does not name."""
    q, marker, k_cache, v_cache, page_table = _paged_case(page_size=4, seed=6)
    expected = varlen_attention_reference(q, marker, k_cache, v_cache, page_table)
    used = set(page_table[page_table >= 0].tolist())
    spare = [p for p in range(k_cache.shape[0]) if p not in used]
    k_cache[spare], v_cache[spare] = float("nan"), float("nan")
    # Slot 0 (one token at position 0) names a spare NaN page as its second page.
    page_table[0, 1] = spare[0]
    out = varlen_attention_reference(q, marker, k_cache, v_cache, page_table)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert k_cache[spare].isnan().all() and v_cache[spare].isnan().all()   # masked a copy
    assert varlen_attention_reference(q[:0], marker[:0], k_cache, v_cache, page_table).shape == (
        0, 6, 32)


# --- The engine's cache: one page of padded_len positions per slot (KVCache.paged) ---

def _engine_paged(k, v):
    """[num_slots, Hkv, max_len, D] contiguous caches -> paged views + page table."""
    return k.transpose(1, 2), v.transpose(1, 2), torch.arange(k.shape[0])[:, None]


def _marker(slots, positions):
    return torch.stack([slots, positions], dim=1)


def _sdpa_per_token(q, k_cache, v_cache, slots, positions, scale=None):
    """Each token on its own: SDPA over keys 0..position of its slot, K/V heads repeated."""
    groups = q.shape[1] // k_cache.shape[1]
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        s, p = int(slots[t]), int(positions[t])
        k = k_cache[s, :, :p + 1].repeat_interleave(groups, dim=0).float()
        v = v_cache[s, :, :p + 1].repeat_interleave(groups, dim=0).float()
        out[t] = F.scaled_dot_product_attention(q[t, :, None].float(), k, v, scale=scale)[:, 0]
    return out


def _ragged_step(gen, requests, shuffle=True):
    """Tokens of several requests: (slot, first position, count) each, optionally shuffled."""
    slots = torch.cat([torch.full((n,), s) for s, _, n in requests])
    positions = torch.cat([torch.arange(p, p + n) for _, p, n in requests])
    if shuffle:
        perm = torch.randperm(slots.numel(), generator=gen)
        slots, positions = slots[perm], positions[perm]
    return slots, positions


@pytest.mark.parametrize("hkv,groups", [(2, 1), (2, 3), (1, 4), (3, 3)])
@pytest.mark.parametrize("requests", [
    [(3, 10, 5), (1, 7, 1), (0, 0, 3), (4, 30, 4)],     # prefill chunks, verify blocks, decode
    [(2, 0, 17)],                                         # one request's prompt
    [(0, 3, 35), (2, 9, 1), (4, 30, 5)],                  # prefill over several grid rows
    [(4, 9, 1), (0, 3, 1), (2, 0, 1)],                    # pure decode, slots out of order
    [(1, 5, 1), (2, 20, 1), (3, 6, 1)],                   # decode over a contiguous slot range
    [(1, 5, 3), (2, 20, 2)],                              # blocks over a contiguous slot range
])
def test_one_page_per_slot_matches_per_token_sdpa(hkv, groups, requests):
    gen = torch.Generator().manual_seed(0)
    num_slots, max_len, d = 5, 40, 16
    k_cache = torch.randn(num_slots, hkv, max_len, d, generator=gen)
    v_cache = torch.randn(num_slots, hkv, max_len, d, generator=gen)
    slots, positions = _ragged_step(gen, requests)
    q = torch.randn(slots.numel(), hkv * groups, d, generator=gen)
    paged = _engine_paged(k_cache, v_cache)
    for scale in (None, 0.3):
        out = varlen_attention(q, _marker(slots, positions), *paged, scale=scale)
        torch.testing.assert_close(
            out, _sdpa_per_token(q, k_cache, v_cache, slots, positions, scale),
            atol=2e-6, rtol=1e-5)


def test_kv_cache_paged_views_are_its_storage():
    cache = KVCache(num_layers=2, num_slots=3, max_len=70, num_kv_heads=2, head_dim=8)
    k, v = cache.paged(1)
    assert k.shape == (3, 2 * KV_BLOCK, 2, 8) and cache.page_table.tolist() == [[0], [1], [2]]
    k[2, 65, 1] = 7.0
    v[0, 3, 0] = 5.0
    assert cache.k[1, 2, 1, 65].tolist() == [7.0] * 8 and cache.v[1, 0, 0, 3].tolist() == [5.0] * 8


def test_plan_layouts():
    def plan(slots, positions, groups, max_len=4 * KV_BLOCK):
        k = torch.zeros(6, max_len, 1, 4)
        return plan_varlen(_marker(torch.tensor(slots), torch.tensor(positions)), groups, k,
                           torch.arange(6)[:, None])

    decode = plan([4, 0, 2], [9, 3, 3], groups=2)
    assert decode.token_index is None and decode.max_q == 1 and decode.kv_len == KV_BLOCK
    assert decode.first_page is None and decode.bias.shape == (3, 1, 2, KV_BLOCK)
    assert decode.row_pages.tolist() == [[4], [0], [2]]
    assert plan([0], [KV_BLOCK], 1).kv_len == 2 * KV_BLOCK
    assert plan([0], [3], 1, max_len=10).kv_len == 10
    full = plan([2], [KV_BLOCK - 1], groups=3)
    assert full.first_page == 2 and bool((full.bias == 0).all())
    mixed = plan([3, 1, 3, 3], [4, 0, 5, 6], groups=1, max_len=7)
    assert mixed.row_slots.tolist() == [1, 3] and mixed.max_q == 3 and mixed.kv_len == 7
    assert mixed.token_index.tolist() == [3, 0, 4, 5] and mixed.first_page is None
    # Padding cells of slot 1's row see key 0 only; slot 3's third query sees keys 0..6.
    inf = float("-inf")
    assert mixed.bias[0, 0, 1].tolist() == [0.0] + [inf] * 6
    assert mixed.bias[1, 0, 2].tolist() == [0.0] * 7
    # groups 3: at most 32 // 3 = 10 queries per grid row.
    long = plan([5] * 25 + [2], list(range(26)), groups=3)
    assert long.max_q == 10 and long.row_slots.tolist() == [2, 5, 5, 5]
    assert long.token_index[:25].tolist() == list(range(10, 35))
    assert long.token_index[25] == 0 and long.bias.shape == (4, 1, 30, KV_BLOCK)
    # Pages of 16: keys 0..63 span 4 pages; pages past a row's last position (unnamed, or
    # named but not yet written) read the row's own first page.
    k16 = torch.zeros(9, 16, 1, 4)
    table = torch.tensor([[5, 6, -1, -1], [7, 8, 1, 2]])
    paged = plan_varlen(_marker(torch.tensor([0, 1]), torch.tensor([17, 40])), 1, k16, table)
    assert paged.row_pages.tolist() == [[5, 6, 5, 5], [7, 8, 1, 7]]
    assert paged.first_page is None


def test_rows_read_only_their_own_pages():
    """Non-finite entries in pages a row does not own (another request's, or pages its
    table names past its last position) leave its output unchanged: 0 * NaN never meets it."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(9, 16, 1, 4, generator=gen), torch.randn(9, 16, 1, 4,
                                                                          generator=gen)
    table = torch.tensor([[5, 6, -1, -1], [7, 8, 1, 2], [0, 3, 4, -1]])
    marker = _marker(torch.tensor([0, 1, 1, 2]), torch.tensor([17, 39, 40, 44]))
    q = torch.randn(4, 2, 4, generator=gen)
    before = varlen_attention(q, marker, k_cache, v_cache, table)
    for page in (0, 2, 3, 4):     # slot 2's pages, and slot 1's page past position 47
        k_cache[page], v_cache[page] = float("nan"), float("inf")
    after = varlen_attention(q[:3], marker[:3], k_cache, v_cache, table)
    assert torch.equal(after, before[:3])


@pytest.mark.parametrize("threads,trials,hkv,groups,d", [
    (1, 300, 1, 3, 64), (1, 100, 2, 4, 128), (2, 100, 1, 3, 64)])  # 2 threads: slow if shared
def test_bfloat16_rows_are_batch_invariant(threads, trials, hkv, groups, d):
    """A token's output has the same bits alone (decode) as inside a block of its request's
    tokens next to another request's block: the property greedy speculative decoding relies
    on. Random positions and block sizes (up to 60 tokens, so prefill-like runs span several
    grid rows); without KV_BLOCK padding or the MAX_GRID_ROWS split some cases differ."""
    gen = torch.Generator().manual_seed(2)
    k_cache = (2 * torch.randn(2, hkv, 704, d, generator=gen)).bfloat16()
    v_cache = torch.randn(2, hkv, 704, d, generator=gen).bfloat16()
    paged = _engine_paged(k_cache, v_cache)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(trials):
            start, other = torch.randint(0, 640, (2,), generator=gen).tolist()
            n, m = torch.randint(1, 60, (2,), generator=gen).tolist()
            slots, positions = _ragged_step(gen, [(0, start, n), (1, other, m)])
            q = (2 * torch.randn(n + m, hkv * groups, d, generator=gen)).bfloat16()
            mixed = varlen_attention(q, _marker(slots, positions), *paged)
            t = int(torch.randint(0, n + m, (1,), generator=gen))
            alone = varlen_attention(q[t:t + 1], _marker(slots, positions)[t:t + 1], *paged)
            assert torch.equal(alone[0], mixed[t])
    finally:
        torch.set_num_threads(before)


def test_plan_must_fit():
    k, v, table = _engine_paged(torch.zeros(2, 2, 8, 4), torch.zeros(2, 2, 8, 4))
    marker = _marker(torch.tensor([0]), torch.tensor([3]))
    plan = plan_varlen(marker, 2, k, table)
    with pytest.raises(ValueError, match="does not fit"):
        varlen_attention(torch.zeros(1, 2, 4), marker, k, v, table, plan=plan)   # groups 1
    with pytest.raises(ValueError, match="does not fit"):
        varlen_attention(torch.zeros(2, 4, 4), torch.cat([marker, marker + 1]), k, v, table,
                         plan=plan)                                               # 2 tokens
    with pytest.raises(ValueError, match="non-empty"):
        plan_varlen(marker[:0], 1, k, table)
    with pytest.raises(ValueError, match="groups"):
        plan_varlen(marker, 0, k, table)
    with pytest.raises(ValueError, match="position in"):
        plan_varlen(_marker(torch.tensor([0]), torch.tensor([8])), 1, k, table)
