import pytest
import torch

from dspark_serve.drafter.context_cache import PAGE_SIZE, DraftContextCache


def make(num_slots=3, max_len=4 * PAGE_SIZE):
    return DraftContextCache(num_layers=2, num_slots=num_slots, max_len=max_len,
                             num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")


def kv(slots, positions):
    """Distinct values per (layer, slot, position): [2, N, 1, 2]."""
    base = (slots * 1000 + positions).float()[None, :, None, None].expand(1, -1, 1, 2)
    k = base + torch.tensor([0.0, 0.5])[:, None, None, None]
    return k, -k


def test_pages_follow_the_context_and_the_store_doubles():
    cache = make()
    assert cache.num_pages == 3                              # one page per slot to start
    slots = torch.tensor([1] * (3 * PAGE_SIZE) + [0] * 5)
    positions = torch.cat([torch.arange(3 * PAGE_SIZE), torch.arange(5)])
    cache.write(slots, positions, *kv(slots, positions))
    assert cache.lengths.tolist() == [5, 3 * PAGE_SIZE, 0] and cache.num_pages == 6
    for slot, length in ((1, 3 * PAGE_SIZE), (0, 5)):
        k, v = cache.context(1, torch.tensor([slot]), length)
        want_k, want_v = kv(torch.full((length,), slot), torch.arange(length))
        assert torch.equal(k[0], want_k[1]) and torch.equal(v[0], want_v[1])


def test_reset_returns_pages_for_reuse():
    cache = make()
    slots = torch.tensor([0] * (3 * PAGE_SIZE))
    cache.write(slots, torch.arange(3 * PAGE_SIZE), *kv(slots, torch.arange(3 * PAGE_SIZE)))
    cache.reset(torch.tensor([0]))
    slots = torch.tensor([1] * (3 * PAGE_SIZE))
    cache.write(slots, torch.arange(3 * PAGE_SIZE), *kv(slots, torch.arange(3 * PAGE_SIZE)))
    assert cache.num_pages == 3 and cache.lengths.tolist() == [0, 3 * PAGE_SIZE, 0]
    k, _ = cache.context(0, torch.tensor([1, 0]), 3 * PAGE_SIZE)
    assert torch.equal(k[0], kv(slots, torch.arange(3 * PAGE_SIZE))[0][0])
    assert k.shape == (2, 3 * PAGE_SIZE, 1, 2) and bool(k.isfinite().all())


def test_rejects_gaps_and_positions_past_max_len():
    cache = make()
    with pytest.raises(ValueError, match="without gaps"):
        cache.write(torch.tensor([0]), torch.tensor([1]), *kv(torch.tensor([0]), torch.tensor([1])))
    with pytest.raises(ValueError, match="positions must be in"):
        cache.write(torch.tensor([0]), torch.tensor([4 * PAGE_SIZE]),
                    *kv(torch.tensor([0]), torch.tensor([0])))


def test_context_states_are_kept_paged_only_when_asked():
    cache = DraftContextCache(num_layers=2, num_slots=2, max_len=4 * PAGE_SIZE, num_kv_heads=1,
                              head_dim=2, dtype=torch.float32, device="cpu", state_dim=3)
    slots = torch.tensor([1] * (2 * PAGE_SIZE + 1))           # grows the store past 2 pages
    positions = torch.arange(2 * PAGE_SIZE + 1)
    h = (slots * 1000 + positions).float()[:, None] + torch.tensor([0.0, 0.25, 0.5])
    cache.write(slots, positions, *kv(slots, positions), h)
    assert cache.num_pages == 4
    got = cache.states(torch.tensor([1, 1, 1]), torch.tensor([PAGE_SIZE + 3, 2 * PAGE_SIZE, -1]))
    assert torch.equal(got, torch.stack([h[PAGE_SIZE + 3], h[2 * PAGE_SIZE], torch.zeros(3)]))
    with pytest.raises(ValueError, match="exactly when"):
        cache.write(slots[:1], positions[:1], *kv(slots[:1], positions[:1]))
    plain = make()
    with pytest.raises(ValueError, match="exactly when"):
        plain.write(slots[:1], positions[:1], *kv(slots[:1], positions[:1]), h[:1])
    with pytest.raises(ValueError, match="no context states"):
        plain.states(torch.tensor([0]), torch.tensor([0]))
