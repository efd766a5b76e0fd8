import pytest
import torch

from dspark_serve.model.kv_cache import KVCache
from dspark_serve.ops.paged_attention import KV_BLOCK


def make(num_slots=3, max_len=8):
    return KVCache(num_layers=2, num_slots=num_slots, max_len=max_len, num_kv_heads=2, head_dim=4)


def test_allocate_free_accounting():
    cache = make()
    assert (cache.capacity_tokens, cache.free_tokens, cache.num_free_slots) == (24, 24, 3)
    a, b = cache.allocate(), cache.allocate()
    assert (a, b) == (0, 1)
    assert (cache.free_tokens, cache.num_free_slots) == (8, 1)
    cache.free(a)
    assert cache.allocate() == 0  # the lowest free slot is reused first
    c = cache.allocate()
    with pytest.raises(RuntimeError, match="full"):
        cache.allocate()
    for slot in (0, b, c):
        cache.free(slot)
    assert (cache.free_tokens, cache.num_free_slots) == (24, 3)


def test_free_rejects_unallocated_and_double_free():
    cache = make()
    with pytest.raises(ValueError, match="not an allocated"):
        cache.free(0)
    slot = cache.allocate()
    cache.free(slot)
    with pytest.raises(ValueError, match="not an allocated"):
        cache.free(slot)
    with pytest.raises(ValueError, match="not an allocated"):
        cache.free(7)


@pytest.mark.parametrize("size", [0, -1, 2.0, True])
def test_rejects_bad_sizes(size):
    with pytest.raises(ValueError, match="positive integer"):
        KVCache(2, size, 8, 2, 4)


def test_write_places_entries_at_slot_and_position():
    cache = make()
    cache.allocate(), cache.allocate()
    slots, positions = torch.tensor([1, 0, 1]), torch.tensor([5, 0, 6])
    k = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    rows = cache.write_rows(slots, positions)
    cache.write(1, rows, k, -k)
    for t in range(3):
        assert torch.equal(cache.k[1, slots[t], :, positions[t]], k[t])
        assert torch.equal(cache.v[1, slots[t], :, positions[t]], -k[t])


@pytest.mark.parametrize("slots,positions,match", [
    ([0, 2], [0, 1], "allocated"),
    ([0, 5], [0, 1], r"slot ids must be in \[0, 3\)"),
    ([0, 1], [0, 8], r"positions must be in \[0, 8\)"),
    ([0, 1], [-1, 0], "positions must be"),
    ([1, 1], [3, 3], "occurs twice"),
    ([0], [0, 1], "same length"),
])
def test_check_tokens_rejects(slots, positions, match):
    cache = make()
    cache.allocate(), cache.allocate()
    with pytest.raises(ValueError, match=match):
        cache.check_tokens(torch.tensor(slots), torch.tensor(positions))


def test_check_tokens_rejects_dtype():
    cache = make()
    cache.allocate()
    with pytest.raises(ValueError, match="int64"):
        cache.check_tokens(torch.tensor([0], dtype=torch.int32), torch.tensor([0]))


def make_pool(num_slots=4, max_len=256, num_pages=6):
    return KVCache(num_layers=1, num_slots=num_slots, max_len=max_len, num_kv_heads=1,
                   head_dim=2, page_size=KV_BLOCK, num_pages=num_pages)


def test_pool_grows_page_by_page_and_frees_everything():
    cache = make_pool()
    assert (cache.capacity_tokens, cache.free_tokens, cache.page_table.shape) == (
        6 * KV_BLOCK, 6 * KV_BLOCK, (4, 4))
    slot = cache.allocate(1)
    assert cache.pages_of(slot) == [0] and cache.reserved_tokens(slot) == KV_BLOCK
    assert cache.reserve(slot, KV_BLOCK)                       # still fits its page
    assert cache.reserve(slot, KV_BLOCK + 1) and cache.pages_of(slot) == [0, 1]
    assert cache.page_table[slot, :2].tolist() == [0, 1]
    assert cache.free_tokens == 4 * KV_BLOCK
    cache.free(slot)
    assert (cache.free_tokens, cache.num_free_pages, cache.num_free_slots) == (6 * KV_BLOCK, 6, 4)


def test_pool_reserve_fails_without_taking_pages():
    cache = make_pool()
    a = cache.allocate(4 * KV_BLOCK)
    b = cache.allocate(KV_BLOCK)
    assert not cache.reserve(b, 3 * KV_BLOCK)                  # needs 2 more, 1 free
    assert cache.pages_of(b) == [4] and cache.num_free_pages == 1
    assert not cache.can_allocate(2 * KV_BLOCK) and cache.can_allocate(KV_BLOCK)
    with pytest.raises(RuntimeError, match="full"):
        cache.allocate(2 * KV_BLOCK)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.reserve(a, 257)
    cache.free(a)
    assert cache.reserve(b, 3 * KV_BLOCK) and cache.pages_of(b) == [4, 0, 1]


def test_pool_positions_must_be_reserved():
    cache = make_pool()
    slot = cache.allocate(10)
    cache.check_tokens(torch.tensor([slot]), torch.tensor([KV_BLOCK - 1]))
    with pytest.raises(ValueError, match="reserved pages"):
        cache.check_tokens(torch.tensor([slot]), torch.tensor([KV_BLOCK]))


def test_pool_rejects_bad_layouts():
    with pytest.raises(ValueError, match="multiple of"):
        KVCache(1, 2, 128, 1, 2, page_size=KV_BLOCK + 1, num_pages=4)
    with pytest.raises(ValueError, match="cannot hold one request"):
        KVCache(1, 2, 4 * KV_BLOCK, 1, 2, page_size=KV_BLOCK, num_pages=3)


def test_pool_writes_follow_the_page_table():
    cache = make_pool()
    a, b = cache.allocate(KV_BLOCK), cache.allocate(KV_BLOCK)
    assert cache.reserve(a, 2 * KV_BLOCK)                      # a: pages 0, 2; b: page 1
    slots, positions = torch.tensor([a, b, a]), torch.tensor([3, 5, KV_BLOCK + 7])
    k = torch.arange(3 * 2, dtype=torch.float32).view(3, 1, 2)
    cache.write(0, cache.write_rows(slots, positions), k, -k)
    for t, (page, offset) in enumerate([(0, 3), (1, 5), (2, 7)]):
        assert torch.equal(cache.k[0, page, :, offset], k[t])
        assert torch.equal(cache.v[0, page, :, offset], -k[t])
    k_pages, _ = cache.paged(0)
    assert torch.equal(k_pages[2, 7], k[2])


def test_pool_of_mixed_lengths_reuses_pages_and_never_leaks():
    """Requests of random lengths come and go (each growing token by token up to its own
    length) until hundreds have passed through: live requests never share a page, a slot's
    pages always cover its tokens, freed pages are reused and all come back at the end."""
    gen = torch.Generator().manual_seed(0)
    cache = make_pool(num_slots=6, max_len=5 * KV_BLOCK, num_pages=16)
    live: dict[int, list[int]] = {}                            # slot -> [tokens, length]
    pages_used, finished = set(), 0
    while finished < 300:
        length = int(torch.randint(1, cache.max_len + 1, (1,), generator=gen))
        if cache.can_allocate(1) and len(live) < 4:
            live[cache.allocate(1)] = [1, length]
        for slot, state in list(live.items()):
            state[0] = min(state[0] + int(torch.randint(1, 40, (1,), generator=gen)), state[1])
            if state[0] == state[1] or not cache.reserve(slot, state[0]):
                cache.free(slot)                               # done, or out of pages
                del live[slot]
                finished += 1
        held = [p for slot in live for p in cache.pages_of(slot)]
        assert len(held) == len(set(held))                     # no page in two requests
        assert len(held) + cache.num_free_pages == cache.num_pages
        for slot, (tokens, _) in live.items():
            assert cache.reserved_tokens(slot) >= tokens
        pages_used.update(held)
    for slot in live:
        cache.free(slot)
    assert pages_used == set(range(cache.num_pages))           # every page served
    assert (cache.num_free_pages, cache.num_free_slots) == (16, 6)
    assert cache.free_tokens == cache.capacity_tokens == 16 * KV_BLOCK
