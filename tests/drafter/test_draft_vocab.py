"""Pruned draft vocabulary: the EAGLE-3 d2t/t2d convention, frequency ranking, a pruned
checkpoint that drafts exactly what the full drafter would restricted to the kept tokens, and
the DeepSpec-format round trip."""
import json

import pytest
import torch

from dspark_serve.assets.default_drafter import draft_vocab_ids
from dspark_serve.drafter.checkpoint import (expand_draft_vocab, load_drafter, prune_draft_vocab,
                                            read_config, save_drafter)
from dspark_serve.drafter.draft_vocab import (RANKING_FILE, d2t_from_ids, ids_from_d2t,
                                              load_ranking, most_frequent_tokens, save_ranking,
                                              scatter_to_vocab, t2d_mask, token_ranking,
                                              top_tokens)
from dspark_serve.types import SamplingTensors

KEEP = torch.tensor([0, 3, 4, 9, 17, 25, 26, 40, 59, 60])


def test_d2t_offsets_and_t2d_follow_eagle3():
    ids = torch.tensor([2, 3, 7, 10])
    assert d2t_from_ids(ids).tolist() == [2, 2, 5, 7]          # id = i + d2t[i]
    assert torch.equal(ids_from_d2t(d2t_from_ids(ids)), ids)
    assert t2d_mask(ids, 12).nonzero().flatten().tolist() == [2, 3, 7, 10]


def test_most_frequent_tokens_ranks_by_count_then_id():
    streams = [[5, 5, 5, 1, 2], [2, 2, 7], [9]]
    # counts: 5:3, 2:3, 1:1, 7:1, 9:1 -> top 3 = 2, 5 (count 3, lower id first), 1
    assert most_frequent_tokens(streams, 3, 10).tolist() == [1, 2, 5]
    # unseen tokens fill up by id
    assert most_frequent_tokens([[8]], 3, 10).tolist() == [0, 1, 8]
    with pytest.raises(ValueError, match="must be in"):
        most_frequent_tokens([[10]], 3, 10)
    with pytest.raises(ValueError, match="size"):
        most_frequent_tokens([[1]], 11, 10)


def test_scatter_to_vocab_is_zero_outside():
    probs = torch.tensor([[0.25, 0.75]])
    out = scatter_to_vocab(probs, torch.tensor([1, 4]), 6)
    assert out.tolist() == [[0.0, 0.25, 0.0, 0.0, 0.75, 0.0]]


def _draft(drafter, seed=0, temperature=1.0):
    cfg = drafter.config
    cache = drafter.new_cache(2, 16)
    g = torch.Generator().manual_seed(seed)
    drafter.extend_context(cache, torch.tensor([0] * 5 + [1] * 5), torch.arange(10) % 5,
                           torch.randn(10, cfg.context_dim, generator=g))
    return drafter.draft(cache, torch.tensor([0, 1]), torch.tensor([3, 11]), torch.tensor([5, 5]),
                         SamplingTensors.uniform(2, temperature),
                         torch.rand(2, drafter.gamma, generator=g))


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_pruned_checkpoint_drafts_the_full_drafter_restricted(tmp_path, tiny_config, tiny_drafter,
                                                              head):
    """Pruning keeps the W2 rows and LM-head rows of the kept tokens, so the pruned drafter's
    draft distribution is the full one's logits restricted to KEEP, renormalised; greedy
    drafts equal the full drafter's argmax over KEEP; probabilities are 0 outside."""
    full = tiny_drafter(tiny_config(markov_head_type=head), seed=3)
    save_drafter(full, tmp_path / "full")
    (tmp_path / "full" / "sts_calibration.json").write_text("{}")
    prune_draft_vocab(tmp_path / "full", tmp_path / "pruned", KEEP)
    assert json.loads((tmp_path / "pruned" / "config.json").read_text())["draft_vocab_size"] == 10
    assert (tmp_path / "pruned" / "sts_calibration.json").read_text() == "{}"
    pruned = load_drafter(tmp_path / "pruned", *full.shared_modules)
    assert torch.equal(pruned.draft_vocab, KEEP)

    block = _draft(pruned)
    assert bool(torch.isin(block.tokens, KEEP).all())
    outside = torch.ones(61, dtype=torch.bool)
    outside[KEEP] = False
    assert float(block.probs[..., outside].abs().max()) == 0.0
    torch.testing.assert_close(block.probs.sum(-1), torch.ones(2, pruned.gamma))

    # Teacher-forced on the pruned drafter's own tokens: the full drafter's logits at KEEP.
    cache_f, cache_p = full.new_cache(2, 16), pruned.new_cache(2, 16)
    taps = torch.randn(10, full.config.context_dim, generator=torch.Generator().manual_seed(0))
    for model, cache in ((full, cache_f), (pruned, cache_p)):
        model.extend_context(cache, torch.tensor([0] * 5 + [1] * 5), torch.arange(10) % 5, taps)
    args = (torch.tensor([0, 1]), torch.tensor([3, 11]), torch.tensor([5, 5]))
    logits_f, conf_f = full.teacher_forced(cache_f, *args, block.tokens)
    logits_p, conf_p = pruned.teacher_forced(cache_p, *args, block.tokens)
    torch.testing.assert_close(logits_p, logits_f[..., KEEP], rtol=0, atol=1e-5)
    torch.testing.assert_close(conf_p, conf_f, rtol=0, atol=1e-5)


def test_pruned_round_trip_and_bad_files(tmp_path, tiny_config, tiny_drafter):
    full = tiny_drafter(tiny_config(), seed=1)
    save_drafter(full, tmp_path / "full")
    prune_draft_vocab(tmp_path / "full", tmp_path / "pruned", KEEP)
    pruned = load_drafter(tmp_path / "pruned", *full.shared_modules)
    save_drafter(pruned, tmp_path / "again")
    again = load_drafter(tmp_path / "again", *full.shared_modules)
    assert again.config == pruned.config
    for key, tensor in pruned.state_dict().items():
        assert torch.equal(again.state_dict()[key], tensor), key
    assert torch.equal(_draft(again, seed=5).tokens, _draft(pruned, seed=5).tokens)

    with pytest.raises(ValueError, match="already has a pruned"):
        prune_draft_vocab(tmp_path / "pruned", tmp_path / "twice", KEEP)
    with pytest.raises(ValueError, match="strictly increasing"):
        prune_draft_vocab(tmp_path / "full", tmp_path / "bad", KEEP.flip(0))
    with pytest.raises(ValueError, match="with a weight"):
        load_drafter(tmp_path / "pruned", full.shared_modules[0], lambda h: h)


def test_expanded_checkpoint_prunes_back_to_the_pruned_drafter(tmp_path, tiny_config,
                                                                tiny_drafter):
    """``expand_draft_vocab`` puts the pruned W2 rows back at their ids (zeros elsewhere) and
    drops d2t: loading it pruned to the same ids gives the pruned drafter's exact tensors and
    drafts, so a drafter trained pruned can ship with the full vocabulary and a ranking."""
    full = tiny_drafter(tiny_config(), seed=2)
    save_drafter(full, tmp_path / "full")
    prune_draft_vocab(tmp_path / "full", tmp_path / "pruned", KEEP)
    expanded = expand_draft_vocab(tmp_path / "pruned", tmp_path / "expanded")
    assert expanded == full.config == read_config(tmp_path / "expanded")
    loaded = load_drafter(tmp_path / "expanded", *full.shared_modules)
    w2 = loaded.state_dict()["markov_head.markov_w2.weight"]
    assert torch.equal(w2[KEEP], full.state_dict()["markov_head.markov_w2.weight"][KEEP])
    outside = torch.ones(w2.shape[0], dtype=torch.bool)
    outside[KEEP] = False
    assert w2[outside].abs().sum() == 0
    pruned = load_drafter(tmp_path / "pruned", *full.shared_modules)
    again = load_drafter(tmp_path / "expanded", *full.shared_modules, draft_vocab=KEEP)
    for key, tensor in pruned.state_dict().items():
        assert torch.equal(again.state_dict()[key], tensor), key
    assert torch.equal(_draft(again, seed=7).probs, _draft(pruned, seed=7).probs)
    with pytest.raises(ValueError, match="no pruned draft vocabulary"):
        expand_draft_vocab(tmp_path / "full", tmp_path / "bad")


def test_token_ranking_file_round_trip(tmp_path):
    ranking = token_ranking([[5, 5, 5, 1, 2], [2, 2, 7], [9]], 10)
    assert ranking.tolist() == [2, 5, 1, 7, 9, 0, 3, 4, 6, 8]
    assert top_tokens(ranking, 3).tolist() == [1, 2, 5]
    assert load_ranking(tmp_path) is None
    save_ranking(tmp_path, ranking)
    assert torch.equal(load_ranking(tmp_path), ranking)
    save_ranking(tmp_path, torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="not a ranking"):
        load_ranking(tmp_path)
    with pytest.raises(ValueError, match="size"):
        top_tokens(ranking, 0)


def test_pruning_at_load_equals_the_pruned_checkpoint(tmp_path, tiny_config, tiny_drafter):
    """``load_drafter(draft_vocab=...)`` prunes in memory exactly as ``prune_draft_vocab`` does
    on disk: same tensors, same drafts."""
    full = tiny_drafter(tiny_config(), seed=4)
    save_drafter(full, tmp_path / "full")
    prune_draft_vocab(tmp_path / "full", tmp_path / "pruned", KEEP)
    on_disk = load_drafter(tmp_path / "pruned", *full.shared_modules)
    at_load = load_drafter(tmp_path / "full", *full.shared_modules, draft_vocab=KEEP)
    assert at_load.config == on_disk.config
    for key, tensor in on_disk.state_dict().items():
        assert torch.equal(at_load.state_dict()[key], tensor), key
    assert torch.equal(_draft(at_load, seed=6).probs, _draft(on_disk, seed=6).probs)
    with pytest.raises(ValueError, match="already has a pruned"):
        load_drafter(tmp_path / "pruned", *full.shared_modules, draft_vocab=KEEP)


def test_engine_draft_vocabulary_from_the_shipped_ranking(tmp_path, tiny_config, tiny_drafter):
    """None: the default size where a ranking ships (capped at V), else the drafter's own
    vocabulary; 0: its own; a size needs a ranking and an unpruned drafter."""
    full = tiny_drafter(tiny_config(), seed=1)
    save_drafter(full, tmp_path / "full")
    config = full.config
    assert draft_vocab_ids(str(tmp_path / "full"), config, None) is None
    with pytest.raises(ValueError, match="no ranking"):
        draft_vocab_ids(str(tmp_path / "full"), config, 10)
    ranking = torch.arange(61).flip(0)
    save_ranking(tmp_path / "full", ranking)
    assert draft_vocab_ids(str(tmp_path / "full"), config, None).tolist() == list(range(61))
    assert draft_vocab_ids(str(tmp_path / "full"), config, 3).tolist() == [58, 59, 60]
    assert draft_vocab_ids(str(tmp_path / "full"), config, 0) is None
    assert draft_vocab_ids(None, config, None) is None          # untrained drafter
    prune_draft_vocab(tmp_path / "full", tmp_path / "pruned", KEEP)
    assert (tmp_path / "pruned" / RANKING_FILE).is_file()     # copied along
    pruned_config = load_drafter(tmp_path / "pruned", *full.shared_modules).config
    assert draft_vocab_ids(str(tmp_path / "pruned"), pruned_config, None) is None
    with pytest.raises(ValueError, match="a pruned vocabulary"):
        draft_vocab_ids(str(tmp_path / "pruned"), pruned_config, 3)
    save_ranking(tmp_path / "full", torch.arange(5))
    with pytest.raises(ValueError, match="5 ids"):
        draft_vocab_ids(str(tmp_path / "full"), config, 3)
