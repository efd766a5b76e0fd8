import pytest
import torch

from dspark_serve.model.kv_cache import KVCache


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
