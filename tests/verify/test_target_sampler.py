"""TargetSampler.verify on hand-made logits: greedy acceptance, recovery and a plain row."""
import torch

from dspark_serve.types import SamplingTensors
from dspark_serve.verify.metadata import SpecMetadata
from dspark_serve.verify.penalties import PenaltyState
from dspark_serve.sampling.warping import warp_probs
from dspark_serve.verify.rejection import rejection_sample
from dspark_serve.verify.target_sampler import SamplingBatch, TargetSampler, greedy_verify

V = 6


def _logits(argmaxes):
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def _batch(rows, penalties=None):
    gen = torch.Generator().manual_seed(0)
    plain = SamplingBatch.plain(SamplingTensors.uniform(rows, 0.0), [gen] * rows)
    return SamplingBatch(plain.sampling, penalties, plain.generators, plain.seeds,
                         plain.num_output, plain.grammars)


def test_greedy_accepts_until_the_first_mismatch():
    drafts = torch.tensor([[2, 3], [0, 0]])
    probs = torch.nn.functional.one_hot(drafts, V).float()
    meta = SpecMetadata.build([0, 3], [2, 0], drafts, probs, 2, "cpu")
    # row 0: target picks 2 (= d_1), then 1 (!= d_2); row 1 (l = 0): target picks 4
    verdict = TargetSampler(V).verify(_logits([2, 1, 5, 4]), meta, _batch(2))
    assert verdict.num_accepted == [1, 0]
    assert verdict.tokens == [[2, 1], [4]]


def test_penalties_see_the_drafted_history():
    drafts = torch.tensor([[2]])
    probs = torch.nn.functional.one_hot(drafts, V).float()
    meta = SpecMetadata.build([0], [1], drafts, probs, 1, "cpu")
    # a presence penalty of 10 removes token 2 after it was drafted (position 1), not before
    penalty = PenaltyState(torch.zeros(1, V), torch.zeros(1, V, dtype=torch.bool),
                           torch.zeros(1), torch.tensor([10.0]), torch.ones(1))
    verdict = TargetSampler(V).verify(_logits([2, 2]), meta, _batch(1, penalty))
    assert verdict.num_accepted == [1] and verdict.tokens[0][0] == 2
    assert verdict.tokens[0][1] != 2


def test_no_rows():
    meta = SpecMetadata.build([], [], torch.zeros(0, 0, dtype=torch.int64), None, 0, "cpu")
    verdict = TargetSampler(V).verify(torch.zeros(0, V), meta, _batch(0))
    assert verdict.tokens == [] and verdict.num_accepted == []


def test_greedy_fast_path_equals_rejection_sampling():
    """All-greedy steps skip warping and rejection sampling (``greedy_verify``): on random
    logits with ties, drafts that partly match the argmax, arbitrary draft distributions and
    lengths 0..gamma, the accepted counts and committed tokens equal rejection sampling's
    over the one-hot targets, for any uniforms."""
    gen = torch.Generator().manual_seed(0)
    r, g, v = 40, 5, 12
    lengths = torch.randint(0, g + 1, (r,), generator=gen).tolist()
    meta_rows = sum(n + 1 for n in lengths)
    logits = torch.randint(0, 4, (meta_rows, v), generator=gen).float()   # many ties
    drafts = torch.randint(0, v, (r, g), generator=gen)
    meta = SpecMetadata.build(list(range(0, 8 * r, 8)), lengths, drafts, None, g, "cpu")
    best = logits.argmax(-1)
    for i, (row, col) in enumerate(zip(meta.logit_rows.tolist(), meta.logit_cols.tolist())):
        if col < g and torch.rand((), generator=gen) < 0.7:
            drafts[row, col] = best[i]                     # accepted unless an earlier miss
    draft_probs = torch.rand(r, g, v, generator=gen)
    draft_probs.scatter_add_(2, drafts[..., None], torch.ones(r, g, 1))  # p_d(draft) > 0
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    num_accepted, tokens = greedy_verify(logits, meta)
    target = torch.zeros(r, g + 1, v)
    target[meta.logit_rows, meta.logit_cols] = warp_probs(
        logits, SamplingTensors.uniform(meta_rows, 0.0))
    for seed in range(3):
        u = torch.rand(r, g + 1, generator=torch.Generator().manual_seed(seed))
        result = rejection_sample(target, drafts, draft_probs, meta.verify_lengths,
                                  u[:, :g].contiguous(), u[:, g].contiguous())
        assert torch.equal(result.num_accepted, num_accepted)
        for k in range(r):
            n = int(num_accepted[k])
            assert torch.equal(result.tokens[k, :n + 1], tokens[k, :n + 1])
    assert 0 < int(num_accepted.sum()) < sum(lengths)      # both outcomes occur
