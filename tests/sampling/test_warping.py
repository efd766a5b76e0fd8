"""warp_probs against a per-row Python reference, plus hand-checked edge cases."""
import math

import pytest
import torch

from dspark_serve.sampling.warping import GREEDY_TEMPERATURE, warp_probs
from dspark_serve.types import SamplingTensors


def reference_warp(logits: list[float], temperature: float, top_k: int, top_p: float,
                   min_p: float) -> list[float]:
    """One row, written out as the documented rules, in float64."""
    vocab = len(logits)
    if temperature < GREEDY_TEMPERATURE:
        best = max(range(vocab), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    peak = max(logits)
    weights = [math.exp((x - peak) / temperature) for x in logits]
    probs = [w / sum(weights) for w in weights]
    ranked = sorted(probs, reverse=True)
    cutoffs = [min_p * ranked[0]]
    if 0 < top_k < vocab:
        cutoffs.append(ranked[top_k - 1])
    if top_p < 1.0:
        in_nucleus = sum(1 for r in range(vocab) if sum(ranked[:r]) < top_p)
        cutoffs.append(ranked[max(in_nucleus, 1) - 1])
    kept = {i for i in range(vocab) if probs[i] >= max(cutoffs)}
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(vocab)]


# (temperature, top_k, top_p, min_p): greedy, plain, each filter alone, k >= V, combinations.
PARAM_ROWS = [
    (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.5, 3, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0), (1.0, 100, 1.0, 0.0), (1.0, 0, 0.5, 0.0), (1.0, 0, 1e-6, 0.0),
    (1.0, 0, 0.95, 0.0), (1.0, 0, 1.0, 0.2), (0.5, 0, 1.0, 0.9), (1.0, 5, 0.8, 0.05),
    (0.8, 2, 0.3, 0.5), (0.0, 3, 0.5, 0.1), (1e-6, 0, 1.0, 0.0), (2.0, 7, 0.9, 0.0),
]


def _params(rows) -> SamplingTensors:
    t, k, p, m = zip(*rows)
    return SamplingTensors(torch.tensor(t, dtype=torch.float32), torch.tensor(k),
                           torch.tensor(p, dtype=torch.float32), torch.tensor(m, dtype=torch.float32))


@pytest.mark.parametrize("vocab", [1, 2, 11, 64, 700])
def test_matches_reference_on_mixed_rows(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = PARAM_ROWS * 4
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    got = warp_probs(logits, _params(rows))
    assert got.dtype == torch.float32 and got.shape == logits.shape
    for r, row in enumerate(rows):
        want = torch.tensor(reference_warp(logits[r].tolist(), *row), dtype=torch.float32)
        torch.testing.assert_close(got[r], want, atol=2e-6, rtol=1e-5)
        assert torch.equal(got[r] > 0, want > 0), f"row {r} {row}: kept set differs"


def _warp_one(probs: list[float], temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    logits = torch.tensor(probs).log()[None]
    return warp_probs(logits, SamplingTensors.uniform(1, temperature, top_k, top_p, min_p))[0]


@pytest.mark.parametrize("top_p, kept", [
    (0.45, [0]),          # top-1 alone already reaches p
    (0.55, [0, 1]),       # smallest prefix with mass >= p
    (0.7, [0, 1]),
    (0.8, [0, 1, 2]),
    (1e-9, [0]),          # tiny p still keeps the most likely token
    (1.0, [0, 1, 2, 3]),  # 1.0 disables, the tiny tail survives
])
def test_top_p_smallest_prefix(top_p, kept):
    got = _warp_one([0.5, 0.25, 0.2499, 0.0001], top_p=top_p)
    assert (got > 0).nonzero().flatten().tolist() == kept
    assert got.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_ties_at_the_cutoff_are_kept_and_large_k_disables():
    assert (_warp_one([0.3, 0.3, 0.3, 0.1], top_k=2) > 0).tolist() == [True, True, True, False]
    assert (_warp_one([0.4, 0.25, 0.25, 0.1], top_p=0.5) > 0).tolist() == [True, True, True, False]
    full = _warp_one([0.3, 0.3, 0.3, 0.1])
    torch.testing.assert_close(_warp_one([0.3, 0.3, 0.3, 0.1], top_k=4), full)
    torch.testing.assert_close(_warp_one([0.3, 0.3, 0.3, 0.1], top_k=10**6), full)


def test_min_p_is_relative_to_post_temperature_max():
    # At temperature 1 the probs are (0.5, 0.3, 0.2); min_p 0.5 keeps p >= 0.25.
    assert (_warp_one([0.5, 0.3, 0.2], min_p=0.5) > 0).tolist() == [True, True, False]
    # At temperature 0.5 they become (25, 9, 4)/38; the threshold 12.5/38 drops token 1.
    got = _warp_one([0.5, 0.3, 0.2], temperature=0.5, min_p=0.5)
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0, 0.0]))
    got = _warp_one([0.5, 0.3, 0.2], temperature=0.5, min_p=0.15)
    torch.testing.assert_close(got, torch.tensor([25 / 38, 9 / 38, 4 / 38]))


def test_greedy_rows_are_one_hot_next_to_sampled_rows():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [0.1, 2.0, -1.0, 2.0]])
    params = SamplingTensors(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]),
                             torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    got = warp_probs(logits, params)
    assert got[0].tolist() == [0.0, 1.0, 0.0, 0.0]  # first of the tied maxima
    torch.testing.assert_close(got[1], torch.softmax(logits[1], -1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_logits_give_float32(dtype):
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(0))
    got = warp_probs(logits.to(dtype), SamplingTensors.uniform(3, top_k=4))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.sum(-1), torch.ones(3))


@pytest.mark.parametrize("field, value, match", [
    ("temperature", -0.1, "temperature"), ("top_k", -1, "top_k"), ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"), ("min_p", 1.5, "min_p"), ("min_p", -0.1, "min_p"),
])
def test_rejects_invalid_parameters(field, value, match):
    params = SamplingTensors.uniform(2)
    getattr(params, field)[1] = value
    with pytest.raises(ValueError, match=match):
        warp_probs(torch.zeros(2, 5), params)


def test_rejects_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="logits"):
        warp_probs(torch.zeros(5), SamplingTensors.uniform(5))
    with pytest.raises(ValueError, match="logits"):
        warp_probs(torch.zeros(2, 5, dtype=torch.int64), SamplingTensors.uniform(2))
    with pytest.raises(ValueError, match="temperature"):
        warp_probs(torch.zeros(3, 5), SamplingTensors.uniform(2))
    bad = SamplingTensors.uniform(2)
    bad.top_k = bad.top_k.int()
    with pytest.raises(ValueError, match="top_k"):
        warp_probs(torch.zeros(2, 5), bad)
