"""Eq 4 left-to-right sampling against the teacher-forced logits of the sampled tokens, and
the drafter's round API end to end."""
import pytest
import torch

from dspark_serve.drafter.block_sampler import sample_block, teacher_forced
from dspark_serve.sampling.sampler import sample_from_probs
from dspark_serve.sampling.warping import warp_probs
from dspark_serve.types import SamplingTensors

SLOTS = torch.tensor([0, 2, 1])
ANCHORS = torch.tensor([4, 59, 0])
LENGTHS = [6, 2, 9]


def _drafter_with_context(tiny_config, tiny_drafter, dtype=torch.float32, **overrides):
    cfg = tiny_config(**overrides)
    drafter = tiny_drafter(cfg, seed=11, dtype=dtype)
    cache = drafter.new_cache(3, 16)
    g = torch.Generator().manual_seed(12)
    for slot, n in zip(SLOTS.tolist(), LENGTHS):
        drafter.extend_context(cache, torch.full((n,), slot), torch.arange(n),
                               torch.randn(n, cfg.context_dim, generator=g).to(dtype))
    return drafter, cache, cache.lengths[SLOTS]


def _sampling(kind):
    s = SamplingTensors.uniform(3, temperature=0.0 if kind == "greedy" else 1.0)
    if kind == "warped":
        s.temperature = torch.tensor([0.7, 1.3, 1.0])
        s.top_k = torch.tensor([0, 5, 3])
        s.top_p = torch.tensor([0.9, 1.0, 0.8])
        s.min_p = torch.tensor([0.0, 0.05, 0.0])
    return s


@pytest.mark.parametrize("head", ["none", "vanilla", "gated", "rnn"])
@pytest.mark.parametrize("kind", ["plain", "warped", "greedy"])
def test_sampling_equals_teacher_forcing_of_sampled_tokens(tiny_config, tiny_drafter, head, kind):
    overrides = (dict(markov_rank=0, confidence_head_with_markov=False) if head == "none"
                 else dict(markov_head_type=head))
    drafter, cache, anchor_pos = _drafter_with_context(tiny_config, tiny_drafter, **overrides)
    sampling = _sampling(kind)
    uniforms = torch.rand(3, drafter.gamma, generator=torch.Generator().manual_seed(13))
    block = drafter.draft(cache, SLOTS, ANCHORS, anchor_pos, sampling, uniforms)
    assert block.tokens.shape == (3, drafter.gamma) and block.tokens.dtype == torch.int64
    assert block.probs.shape == (3, drafter.gamma, 61) and block.probs.dtype == torch.float32
    logits, conf = drafter.teacher_forced(cache, SLOTS, ANCHORS, anchor_pos, block.tokens)
    assert torch.equal(block.conf_logits, conf) and conf.abs().min() > 0
    for k in range(drafter.gamma):
        probs_k = warp_probs(logits[:, k], sampling)
        assert torch.equal(block.probs[:, k], probs_k)
        expected = sample_from_probs(probs_k, uniforms[:, k].contiguous())
        assert torch.equal(block.tokens[:, k], expected)
    if kind == "greedy":
        assert torch.equal(block.tokens, logits.argmax(-1))
    # The draws must not all be the argmax, or "sampling" was never exercised.
    if kind == "plain":
        assert not torch.equal(block.tokens, logits.argmax(-1))


def test_markov_bias_conditions_on_previous_token(tiny_config, tiny_drafter):
    drafter, cache, anchor_pos = _drafter_with_context(tiny_config, tiny_drafter)
    head = drafter.markov_head
    hidden, base = drafter.block_forward(cache, SLOTS, ANCHORS, anchor_pos)
    tokens_a = torch.tensor([[1, 2, 3, 4, 5]] * 3)
    tokens_b = tokens_a.clone()
    tokens_b[:, 1] = 9
    conf_head = drafter.confidence_head
    logits_a, conf_a = teacher_forced(base, hidden, ANCHORS, tokens_a, head, conf_head)
    logits_b, conf_b = teacher_forced(base, hidden, ANCHORS, tokens_b, head, conf_head)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    # x_0 is the anchor: position 1 gets W1[anchor] W2.
    torch.testing.assert_close(logits_a[:, 0], base[:, 0] + w1[ANCHORS] @ w2.T)
    # Changing x_2 changes only position 3 (memoryless head), by the bias difference.
    changed = (logits_a - logits_b).abs().amax(-1).amax(0)
    assert changed.nonzero().flatten().tolist() == [2]
    torch.testing.assert_close(logits_a[:, 2] - logits_b[:, 2],
                               ((w1[2] - w1[9]) @ w2.T).expand(3, -1), rtol=1e-5, atol=1e-5)
    assert (conf_a[:, 2] != conf_b[:, 2]).all() and torch.equal(conf_a[:, :2], conf_b[:, :2])


def test_draft_without_confidence_head_and_in_bf16(tiny_config, tiny_drafter):
    drafter, cache, anchor_pos = _drafter_with_context(
        tiny_config, tiny_drafter, dtype=torch.bfloat16, enable_confidence_head=False,
        confidence_head_with_markov=False)
    assert cache.k.dtype == torch.bfloat16
    block = drafter.draft(cache, SLOTS, ANCHORS, anchor_pos, _sampling("plain"),
                          torch.rand(3, drafter.gamma, generator=torch.Generator().manual_seed(0)))
    assert block.probs.dtype == torch.float32 and block.conf_logits.dtype == torch.float32
    assert not block.conf_logits.any()
    torch.testing.assert_close(block.probs.sum(-1), torch.ones(3, drafter.gamma))


def test_bad_inputs_raise():
    base, hidden = torch.zeros(2, 3, 7), torch.zeros(2, 3, 4)
    anchors, sampling = torch.tensor([1, 2]), SamplingTensors.uniform(2)
    with pytest.raises(ValueError, match="uniforms"):
        sample_block(base, hidden, anchors, None, None, sampling, torch.rand(2, 4))
    with pytest.raises(ValueError, match="anchor_tokens"):
        sample_block(base, hidden, anchors.int(), None, None, sampling, torch.rand(2, 3))
    with pytest.raises(ValueError, match="hidden"):
        teacher_forced(base, hidden[:, :2], anchors, torch.zeros(2, 3, dtype=torch.long),
                       None, None)
    with pytest.raises(ValueError, match="tokens"):
        teacher_forced(base, hidden, anchors, torch.zeros(2, 2, dtype=torch.long), None, None)
