"""sample_from_probs against a per-row inverse-CDF reference; draw_uniforms streams."""
import pytest
import torch
from scipy import stats

from dspark_serve.sampling.sampler import draw_uniforms, sample_from_probs

LARGEST_BELOW_ONE = 1.0 - 2.0 ** -24  # largest float32 < 1


def reference_sample(probs: list[float], u: float) -> int:
    """First token whose cumulative mass exceeds u * total (float64); only tokens with mass."""
    target, mass = u * sum(probs), 0.0
    candidates = [i for i, p in enumerate(probs) if p > 0]
    for i in candidates:
        mass += probs[i]
        if mass > target:
            return i
    return candidates[-1]


def _sparse_probs(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Random distributions with about half the tokens (including the tails) at zero."""
    probs = torch.rand(rows, vocab, generator=gen) * (torch.rand(rows, vocab, generator=gen) < 0.5)
    probs[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] += 0.1
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("vocab", [1, 3, 8, 257])
def test_matches_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    probs = _sparse_probs(gen, 500, vocab)
    uniforms = torch.rand(500, generator=gen)
    uniforms[:50] = 0.0
    uniforms[50:100] = LARGEST_BELOW_ONE
    got = sample_from_probs(probs, uniforms)
    assert got.dtype == torch.int64
    want = [reference_sample(p, u) for p, u in zip(probs.tolist(), uniforms.tolist())]
    assert got.tolist() == want


def test_never_returns_zero_probability_token_near_one():
    # Ten 0.1s sum to slightly more or less than 1 in float32, the tail has no mass:
    # u just below 1 must still land on the last token with mass, never in the tail.
    probs = torch.zeros(4, 16)
    probs[:, :10] = 0.1
    probs[1, 3] = 0.0
    probs[2] *= 7.0  # unnormalised weights
    probs[3, 9] = 0.0
    got = sample_from_probs(probs, torch.full((4,), LARGEST_BELOW_ONE))
    assert got.tolist() == [9, 9, 9, 8]
    assert sample_from_probs(probs, torch.zeros(4)).tolist() == [0, 0, 0, 0]


def test_leading_zero_mass_is_skipped_at_u_zero():
    probs = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.7]])
    assert sample_from_probs(probs, torch.zeros(1)).tolist() == [2]
    assert sample_from_probs(probs, torch.tensor([0.3])).tolist() == [4]


def test_unnormalised_weights_sample_like_normalised():
    gen = torch.Generator().manual_seed(1)
    probs = _sparse_probs(gen, 300, 6)
    uniforms = torch.rand(300, generator=gen)
    assert torch.equal(sample_from_probs(probs * 4.0, uniforms), sample_from_probs(probs, uniforms))


def test_empirical_distribution_matches_probs():
    probs = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.3, 0.0])
    n = 100_000
    tokens = sample_from_probs(probs.expand(n, -1).contiguous(),
                               torch.rand(n, generator=torch.Generator().manual_seed(2)))
    counts = torch.bincount(tokens, minlength=6)
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    expected = probs[keep].double() / probs[keep].double().sum() * n
    p_value = stats.chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue
    assert p_value > 1e-3


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="positive"):
        sample_from_probs(torch.tensor([[0.5, 0.5], [0.0, 0.0]]), torch.zeros(2))
    with pytest.raises(ValueError, match="positive"):
        sample_from_probs(torch.tensor([[float("nan"), 0.5]]), torch.zeros(1))
    with pytest.raises(ValueError, match="probs"):
        sample_from_probs(torch.ones(2, 3, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(ValueError, match="uniforms"):
        sample_from_probs(torch.ones(2, 3), torch.zeros(3))


def test_seeded_streams_ignore_batch_composition():
    def gens():
        return [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)]
    a = draw_uniforms(gens(), 5, "cpu")
    assert a.shape == (3, 5) and a.dtype == torch.float32
    assert ((a >= 0) & (a < 1)).all()
    alone = draw_uniforms([torch.Generator().manual_seed(8)], 5, "cpu")
    assert torch.equal(a[2], alone[0])
    assert torch.equal(a[0], torch.rand(5, generator=torch.Generator().manual_seed(7)))
    # A stream advances by n per call: two calls of 2 and 3 equal one call of 5.
    g = torch.Generator().manual_seed(7)
    split = torch.cat([draw_uniforms([g], 2, "cpu"), draw_uniforms([g], 3, "cpu")], dim=1)
    assert torch.equal(split[0], a[0])


def test_unseeded_rows_use_global_rng():
    torch.manual_seed(123)
    first = draw_uniforms([None, None], 4, "cpu")
    torch.manual_seed(123)
    assert torch.equal(draw_uniforms([None, None], 4, "cpu"), first)
    assert draw_uniforms([], 3, "cpu").shape == (0, 3)
    assert draw_uniforms([None], 0, "cpu").shape == (1, 0)


def test_draw_uniforms_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n must be"):
        draw_uniforms([None], -1, "cpu")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="generator"):
            draw_uniforms([torch.Generator()], 2, "cuda")
