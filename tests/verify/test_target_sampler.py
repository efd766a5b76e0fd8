"""TargetSampler.verify on hand-made logits: greedy acceptance, recovery and a plain row."""
import torch

from dspark_serve.types import SamplingTensors
from dspark_serve.verify.metadata import SpecMetadata
from dspark_serve.verify.penalties import PenaltyState
from dspark_serve.verify.target_sampler import SamplingBatch, TargetSampler

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
