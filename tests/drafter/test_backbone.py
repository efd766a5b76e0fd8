"""Backbone (Eq 2-3) and context cache: visibility against an explicit masked-attention
reference, batching over slots with different context lengths, incremental caching."""
import pytest
import torch

from dspark_serve.types import SamplingTensors

TOL = dict(rtol=1e-4, atol=1e-4)


def _taps(n, cfg, seed):
    return torch.randn(n, cfg.context_dim, generator=torch.Generator().manual_seed(seed))


def test_block_matches_explicit_masked_attention_reference(tiny_config, tiny_drafter,
                                                           reference_block_hidden):
    """Context positions >= anchor_pos are cached but must stay invisible; the block is
    bidirectional. A causal-block reference differs, so the check has teeth."""
    cfg = tiny_config()
    drafter = tiny_drafter(cfg)
    taps = _taps(20, cfg, 1)
    cache = drafter.new_cache(2, 32)
    drafter.extend_context(cache, torch.full((20,), 1), torch.arange(20), taps)
    for anchor_pos in (0, 7, 20):
        hidden, logits = drafter.block_forward(cache, torch.tensor([1]), torch.tensor([9]),
                                               torch.tensor([anchor_pos]))
        ref = reference_block_hidden(drafter, taps, 9, anchor_pos)
        torch.testing.assert_close(hidden[0].double(), ref, **TOL)
        torch.testing.assert_close(logits[0].double(),
                                   ref @ drafter.shared_modules[1].weight.double().T, **TOL)
        causal = reference_block_hidden(drafter, taps, 9, anchor_pos, causal_block=True)
        assert (causal[:-1] - ref[:-1]).abs().max() > 1e-2
    # Seeing one context position too many must change the output as well.
    leaky = reference_block_hidden(drafter, taps[:8], 9, 8)
    assert (leaky - reference_block_hidden(drafter, taps[:8], 9, 7)).abs().max() > 1e-2


def test_a_short_draft_is_the_block_cut_to_its_first_slots(tiny_config, tiny_drafter,
                                                            reference_block_hidden):
    """num_drafts = g runs a block of label_offset + g slots: the reference of a drafter whose
    block_size is that (same weights), not the first g rows of the full block (they attend
    to every mask slot, so they differ); draft() takes g from its uniforms."""
    drafter = tiny_drafter(tiny_config(block_size=5), seed=3)
    short = tiny_drafter(tiny_config(block_size=3), seed=3)    # same seed: same weights
    taps = _taps(12, drafter.config, 4)
    cache = drafter.new_cache(1, 16)
    drafter.extend_context(cache, torch.zeros(12, dtype=torch.long), torch.arange(12), taps)
    args = (cache, torch.tensor([0]), torch.tensor([9]), torch.tensor([12]))
    hidden, logits = drafter.block_forward(*args, num_drafts=3)
    assert hidden.shape == (1, 3, drafter.config.hidden_size) and logits.shape[:2] == (1, 3)
    ref = reference_block_hidden(short, taps, 9, 12)
    torch.testing.assert_close(hidden[0].double(), ref, **TOL)
    full, _ = drafter.block_forward(*args)
    assert (full[0, :3].double() - ref).abs().max() > 1e-2
    block = drafter.draft(*args, SamplingTensors.uniform(1, temperature=1.0),
                          torch.rand(1, 2, generator=torch.Generator().manual_seed(5)))
    assert block.tokens.shape == block.conf_logits.shape == (1, 2)
    for bad in (0, 6):
        with pytest.raises(ValueError, match="num_drafts"):
            drafter.block_forward(*args, num_drafts=bad)


def test_batched_slots_with_different_context_lengths(tiny_config, tiny_drafter,
                                                      reference_block_hidden):
    cfg = tiny_config(num_attention_heads=4, num_key_value_heads=1)
    drafter = tiny_drafter(cfg, seed=3)
    lengths = {0: 3, 2: 11, 3: 1}
    taps = {s: _taps(n, cfg, 10 + s) for s, n in lengths.items()}
    cache = drafter.new_cache(4, 16)
    slots = torch.cat([torch.full((n,), s) for s, n in lengths.items()])
    positions = torch.cat([torch.arange(n) for n in lengths.values()])
    drafter.extend_context(cache, slots, positions, torch.cat(list(taps.values())))
    assert cache.lengths.tolist() == [3, 0, 11, 1]
    order = torch.tensor([2, 0, 3])
    anchors = torch.tensor([5, 17, 33])
    hidden, _ = drafter.block_forward(cache, order, anchors, cache.lengths[order])
    assert hidden.shape == (3, cfg.gamma, cfg.hidden_size)
    for row, (slot, anchor) in enumerate(zip(order.tolist(), anchors.tolist())):
        ref = reference_block_hidden(drafter, taps[slot], anchor, lengths[slot])
        torch.testing.assert_close(hidden[row].double(), ref, **TOL)


def test_incremental_context_equals_one_shot(tiny_config, tiny_drafter):
    cfg = tiny_config()
    drafter = tiny_drafter(cfg, seed=5)
    taps = _taps(13, cfg, 2)
    one_shot = drafter.new_cache(3, 16)
    drafter.extend_context(one_shot, torch.full((13,), 2), torch.arange(13), taps)
    chunked = drafter.new_cache(3, 16)
    for chunk, (lo, hi) in enumerate(((0, 5), (5, 6), (6, 13))):
        # Another slot's tokens interleaved in the same call must not disturb slot 2.
        slots = torch.cat([torch.full((hi - lo,), 2), torch.tensor([0])])
        positions = torch.cat([torch.arange(lo, hi), torch.tensor([chunk])])
        drafter.extend_context(chunked, slots, positions, torch.cat([taps[lo:hi], taps[:1]]))
    assert chunked.lengths[2] == 13
    torch.testing.assert_close(chunked.k[:, 2], one_shot.k[:, 2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked.v[:, 2], one_shot.v[:, 2], rtol=1e-6, atol=1e-6)
    args = (torch.tensor([2]), torch.tensor([4]), torch.tensor([13]))
    torch.testing.assert_close(drafter.block_forward(chunked, *args)[0],
                               drafter.block_forward(one_shot, *args)[0], rtol=1e-5, atol=1e-5)


def test_cache_rejects_gaps_and_bad_anchors(tiny_config, tiny_drafter):
    cfg = tiny_config()
    drafter = tiny_drafter(cfg)
    cache = drafter.new_cache(2, 8)
    taps = _taps(4, cfg, 0)
    drafter.extend_context(cache, torch.zeros(3, dtype=torch.long), torch.arange(3), taps[:3])
    with pytest.raises(ValueError, match="gaps"):
        drafter.extend_context(cache, torch.tensor([0]), torch.tensor([4]), taps[:1])
    with pytest.raises(ValueError, match="gaps"):  # a duplicate position in the extension
        drafter.extend_context(cache, torch.tensor([0, 0]), torch.tensor([3, 3]), taps[:2])
    with pytest.raises(ValueError, match="positions"):
        drafter.extend_context(cache, torch.tensor([1]), torch.tensor([8]), taps[:1])
    with pytest.raises(ValueError, match="slot ids"):
        drafter.extend_context(cache, torch.tensor([2]), torch.tensor([0]), taps[:1])
    with pytest.raises(ValueError, match="target_hidden"):
        drafter.extend_context(cache, torch.tensor([1]), torch.tensor([0]), taps[:1, :-1])
    assert cache.lengths.tolist() == [3, 0]
    # Rewriting a cached position is allowed; the length does not shrink.
    drafter.extend_context(cache, torch.tensor([0]), torch.tensor([1]), taps[:1])
    assert cache.lengths.tolist() == [3, 0]
    with pytest.raises(ValueError, match="anchor position"):
        drafter.block_forward(cache, torch.tensor([0]), torch.tensor([1]), torch.tensor([4]))
    cache.reset(torch.tensor([0]))
    assert cache.lengths.tolist() == [0, 0]
    with pytest.raises(ValueError, match="anchor position"):
        drafter.block_forward(cache, torch.tensor([0]), torch.tensor([1]), torch.tensor([1]))
