"""markov_sample_reference (the CPU path and the CUDA kernel's reference) against a plain
per-request, per-position loop with its own sort-based warping."""
import pytest
import torch

from dspark_serve.drafter.block_sampler import sample_block
from dspark_serve.drafter.confidence_head import ConfidenceHead
from dspark_serve.drafter.markov_head import MarkovHead
from dspark_serve.ops import markov_sample, markov_sample_reference, philox_uniforms
from dspark_serve.types import SamplingTensors

# Rows: greedy, temperature only, top-k, top-p, min-p, all filters, top-k = 1.
TEMPERATURE = [0.0, 0.7, 1.0, 1.0, 1.0, 1.3, 0.9]
TOP_K = [0, 0, 5, 0, 0, 10, 1]
TOP_P = [1.0, 1.0, 1.0, 0.8, 1.0, 0.9, 1.0]
MIN_P = [0.0, 0.0, 0.0, 0.0, 0.2, 0.05, 0.0]


def _sampling(rows):
    return SamplingTensors(torch.tensor(TEMPERATURE[:rows]), torch.tensor(TOP_K[:rows]),
                           torch.tensor(TOP_P[:rows]), torch.tensor(MIN_P[:rows]))


def _inputs(rows=7, gamma=5, vocab=97, rank=16, d=12, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(rows, gamma, vocab, generator=g) * 2).to(dtype)
    hidden = torch.randn(rows, gamma, d, generator=g).to(dtype)
    w1 = torch.randn(vocab, rank, generator=g).to(dtype)
    w2 = (torch.randn(vocab, rank, generator=g) * 0.3).to(dtype)
    anchor = torch.randint(0, vocab, (rows,), generator=g)
    conf_w = torch.randn(d + rank, generator=g).to(dtype)
    conf_b = torch.randn(1, generator=g).to(dtype)
    uniforms = philox_uniforms(torch.arange(rows) + 100 * seed,
                               torch.zeros(rows, dtype=torch.int64), gamma)
    return base, hidden, w1, w2, anchor, conf_w, conf_b, uniforms


def _warp_row(logits, t, k, p, min_p):
    """Sort-based warping of one row, written from the definitions."""
    vocab = logits.numel()
    if t < 1e-5:
        out = torch.zeros(vocab)
        out[int(torch.argmax(logits))] = 1.0
        return out
    probs = torch.softmax(logits / t, dim=-1)
    ordered = probs.sort(descending=True).values
    cutoff = torch.tensor(0.0)
    if 0 < k < vocab:
        cutoff = torch.maximum(cutoff, ordered[k - 1])
    if p < 1.0:
        preceding = ordered.cumsum(0) - ordered  # mass strictly before each sorted token
        cutoff = torch.maximum(cutoff, ordered[int((preceding < p).sum()) - 1])
    if min_p > 0.0:
        cutoff = torch.maximum(cutoff, min_p * ordered[0])
    kept = torch.where(probs >= cutoff, probs, 0.0)
    return kept / kept.sum()


def _loop(base, hidden, w1, w2, anchor, conf_w, conf_b, uniforms, rows):
    """Per request r, per position k: Eq 5 bias, warping, inverse CDF, Eq 7 logit."""
    _, gamma, vocab = base.shape
    d = hidden.shape[2]
    tokens = torch.zeros(rows, gamma, dtype=torch.int64)
    probs = torch.zeros(rows, gamma, vocab)
    conf = torch.zeros(rows, gamma)
    for r in range(rows):
        prev = int(anchor[r])
        for k in range(gamma):
            emb = w1[prev].float()
            logits = base[r, k].float() + w2.float() @ emb
            p = _warp_row(logits, TEMPERATURE[r], TOP_K[r], TOP_P[r], MIN_P[r])
            conf[r, k] = (hidden[r, k].float() * conf_w[:d].float()).sum() \
                + (emb * conf_w[d:].float()).sum() + conf_b.float()[0]
            cdf = p.cumsum(0)
            tok = int((cdf <= uniforms[r, k] * cdf[-1]).sum())
            prev = min(tok, int(torch.nonzero(p).max()))
            tokens[r, k], probs[r, k] = prev, p
    return tokens, probs, conf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_matches_per_request_loop(dtype, seed):
    base, hidden, w1, w2, anchor, conf_w, conf_b, u = _inputs(dtype=dtype, seed=seed)
    block = markov_sample_reference(base, hidden, w1, w2, anchor, _sampling(7), u, conf_w, conf_b)
    tokens, probs, conf = _loop(base, hidden, w1, w2, anchor, conf_w, conf_b, u, 7)
    assert torch.equal(block.tokens, tokens)
    torch.testing.assert_close(block.probs, probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(block.conf_logits, conf, rtol=1e-5, atol=1e-5)
    # The filters really cut: greedy one-hot, top-k=5 keeps 5 tokens, top-k=1 keeps 1.
    assert torch.equal((block.probs[0] > 0).sum(-1), torch.ones(5, dtype=torch.int64))
    assert torch.equal((block.probs[2] > 0).sum(-1), torch.full((5,), 5))
    assert torch.equal((block.probs[6] > 0).sum(-1), torch.ones(5, dtype=torch.int64))


def test_markov_bias_drives_the_chain():
    # W1[x] . W2[y] = 40 when y == x + 1 (mod V), so greedy decoding counts up from the anchor.
    vocab, gamma = 16, 6
    w1 = torch.eye(vocab)
    w2 = torch.roll(torch.eye(vocab), shifts=1, dims=0) * 40.0
    base = torch.randn(2, gamma, vocab)
    anchor = torch.tensor([3, 14])
    block = markov_sample_reference(base, torch.zeros(2, gamma, 0), w1, w2, anchor,
                                    SamplingTensors.uniform(2, temperature=0.0),
                                    torch.rand(2, gamma))
    expected = (anchor[:, None] + torch.arange(1, gamma + 1)) % vocab
    assert torch.equal(block.tokens, expected)
    assert torch.equal(block.conf_logits, torch.zeros(2, gamma))


def test_matches_block_sampler_with_markov_and_confidence_heads():
    base, hidden, w1, w2, anchor, conf_w, conf_b, u = _inputs(seed=3)
    vocab, rank = w1.shape
    head, conf_head = MarkovHead(vocab, rank), ConfidenceHead(hidden.shape[2], rank)
    with torch.no_grad():
        head.markov_w1.weight.copy_(w1)
        head.markov_w2.weight.copy_(w2)
        conf_head.proj.weight.copy_(conf_w[None])
        conf_head.proj.bias.copy_(conf_b)
        expected = sample_block(base, hidden, anchor, head, conf_head, _sampling(7), u)
    block = markov_sample_reference(base, hidden, w1, w2, anchor, _sampling(7), u, conf_w, conf_b)
    assert torch.equal(block.tokens, expected.tokens)
    torch.testing.assert_close(block.probs, expected.probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(block.conf_logits, expected.conf_logits, rtol=1e-5, atol=1e-5)


def test_dispatcher_on_cpu_is_the_reference():
    args = _inputs(seed=4)
    base, hidden, w1, w2, anchor, conf_w, conf_b, u = args
    a = markov_sample(base, hidden, w1, w2, anchor, _sampling(7), u, conf_w, conf_b)
    b = markov_sample_reference(base, hidden, w1, w2, anchor, _sampling(7), u, conf_w, conf_b)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs)


def test_empty_block():
    base, hidden, w1, w2, anchor, conf_w, conf_b, _ = _inputs(gamma=0)
    block = markov_sample(base, hidden, w1, w2, anchor, _sampling(7), torch.zeros(7, 0),
                          conf_w, conf_b)
    assert block.tokens.shape == (7, 0) and block.probs.shape == (7, 0, 97)


def test_bad_inputs():
    base, hidden, w1, w2, anchor, conf_w, conf_b, u = _inputs()
    s = _sampling(7)
    with pytest.raises(ValueError, match="anchor ids"):
        markov_sample(base, hidden, w1, w2, anchor + 97, s, u)
    with pytest.raises(ValueError, match="uniforms must be in"):
        markov_sample(base, hidden, w1, w2, anchor, s, u + 1.0)
    with pytest.raises(ValueError, match="w1 and w2"):
        markov_sample(base, hidden, w1, w2[:, :8], anchor, s, u)
    with pytest.raises(ValueError, match="conf_weight must be"):
        markov_sample(base, hidden, w1, w2, anchor, s, u, conf_w[1:], conf_b)
    with pytest.raises(ValueError, match="together"):
        markov_sample(base, hidden, w1, w2, anchor, s, u, conf_w, None)
    with pytest.raises(ValueError, match="uniforms must be float32"):
        markov_sample(base, hidden, w1, w2, anchor, s, u[:, :2])
