import pytest
import torch
import torch.nn.functional as F

from dspark_serve.engine.attention import KV_BLOCK, plan_varlen, varlen_attention


def reference(q, k_cache, v_cache, slots, positions, scale=None):
    """Each token on its own: SDPA over keys 0..position of its slot, K/V heads repeated."""
    groups = q.shape[1] // k_cache.shape[1]
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        s, p = int(slots[t]), int(positions[t])
        k = k_cache[s, :, :p + 1].repeat_interleave(groups, dim=0).float()
        v = v_cache[s, :, :p + 1].repeat_interleave(groups, dim=0).float()
        out[t] = F.scaled_dot_product_attention(q[t, :, None].float(), k, v, scale=scale)[:, 0]
    return out


def ragged_step(gen, num_slots, max_len, requests, shuffle=True):
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
def test_matches_per_token_sdpa(hkv, groups, requests):
    gen = torch.Generator().manual_seed(0)
    num_slots, max_len, d = 5, 40, 16
    k_cache = torch.randn(num_slots, hkv, max_len, d, generator=gen)
    v_cache = torch.randn(num_slots, hkv, max_len, d, generator=gen)
    slots, positions = ragged_step(gen, num_slots, max_len, requests)
    q = torch.randn(slots.numel(), hkv * groups, d, generator=gen)
    out = varlen_attention(q, k_cache, v_cache, slots, positions)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, slots, positions),
                               atol=2e-6, rtol=1e-5)
    scaled = varlen_attention(q, k_cache, v_cache, slots, positions, scale=0.3)
    torch.testing.assert_close(scaled, reference(q, k_cache, v_cache, slots, positions, 0.3),
                               atol=2e-6, rtol=1e-5)


def test_plan_layouts():
    decode = plan_varlen(torch.tensor([4, 0, 2]), torch.tensor([9, 3, 3]), groups=2)
    assert decode.token_index is None and decode.max_q == 1 and decode.kv_len == KV_BLOCK
    assert decode.first_slot is None and decode.bias.shape == (3, 1, 2, KV_BLOCK)
    assert plan_varlen(torch.tensor([0]), torch.tensor([KV_BLOCK]), 1).kv_len == 2 * KV_BLOCK
    assert plan_varlen(torch.tensor([0]), torch.tensor([3]), 1, max_len=10).kv_len == 10
    full = plan_varlen(torch.tensor([2]), torch.tensor([KV_BLOCK - 1]), groups=3)
    assert full.first_slot == 2 and bool((full.bias == 0).all())
    mixed = plan_varlen(torch.tensor([3, 1, 3, 3]), torch.tensor([4, 0, 5, 6]), groups=1,
                        max_len=7)
    assert mixed.row_slots.tolist() == [1, 3] and mixed.max_q == 3 and mixed.kv_len == 7
    assert mixed.token_index.tolist() == [3, 0, 4, 5] and mixed.first_slot is None
    # Padding cells of slot 1's row see key 0 only; slot 3's third query sees keys 0..6.
    # groups 3: at most 32 // 3 = 10 queries per grid row.
    long = plan_varlen(torch.tensor([5] * 25 + [2]), torch.arange(26), groups=3)
    assert long.max_q == 10 and long.row_slots.tolist() == [2, 5, 5, 5]
    assert long.token_index[:25].tolist() == list(range(10, 35))
    assert long.token_index[25] == 0 and long.bias.shape == (4, 1, 30, KV_BLOCK)
    inf = float("-inf")
    assert mixed.bias[0, 0, 1].tolist() == [0.0] + [inf] * 6
    assert mixed.bias[1, 0, 2].tolist() == [0.0] * 7


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
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(trials):
            start, other = torch.randint(0, 640, (2,), generator=gen).tolist()
            n, m = torch.randint(1, 60, (2,), generator=gen).tolist()
            slots, positions = ragged_step(gen, 2, 704, [(0, start, n), (1, other, m)])
            q = (2 * torch.randn(n + m, hkv * groups, d, generator=gen)).bfloat16()
            mixed = varlen_attention(q, k_cache, v_cache, slots, positions)
            t = int(torch.randint(0, n + m, (1,), generator=gen))
            alone = varlen_attention(q[t:t + 1], k_cache, v_cache, slots[t:t + 1],
                                     positions[t:t + 1])
            assert torch.equal(alone[0], mixed[t])
    finally:
        torch.set_num_threads(before)


def test_bfloat16_close_to_float32():
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(3, 2, 32, 8, generator=gen)
    v_cache = torch.randn(3, 2, 32, 8, generator=gen)
    slots, positions = ragged_step(gen, 3, 32, [(0, 4, 6), (2, 20, 1)])
    q = torch.randn(slots.numel(), 4, 8, generator=gen)
    out = varlen_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), slots, positions)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, slots, positions),
                               atol=3e-2, rtol=3e-2)


def test_rejects_bad_inputs():
    k = torch.zeros(2, 2, 8, 4)
    with pytest.raises(ValueError, match="head_dim"):
        varlen_attention(torch.zeros(1, 4, 5), k, k, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="divisible"):
        varlen_attention(torch.zeros(1, 3, 4), k, k, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="needs slots"):
        varlen_attention(torch.zeros(1, 4, 4), k, k)
    with pytest.raises(ValueError, match="does not fit a cache of 8"):
        varlen_attention(torch.zeros(1, 4, 4), k, k, torch.tensor([0]), torch.tensor([8]))
    plan = plan_varlen(torch.tensor([0]), torch.tensor([3]), 2)  # kv_len 64 > 8
    with pytest.raises(ValueError, match="does not fit q/caches"):
        varlen_attention(torch.zeros(1, 4, 4), k, k, plan=plan)
    with pytest.raises(ValueError, match="non-empty"):
        plan_varlen(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="groups"):
        plan_varlen(torch.tensor([0]), torch.tensor([0]), 0)
