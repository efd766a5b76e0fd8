"""Grammar masks inside a speculative round (``dspark_serve.structured.masking``) on the real
tokenizer: masks after the drafted tokens, positions that cannot matter left open, state
rolled back, and the draft projection (truncation, redraw, renormalisation) exact."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats

from dspark_serve.structured.masking import (bitmask_to_bool, constrain_drafts, mask_logits,
                                             new_bitmask, verify_bitmask)
from dspark_serve.structured.spec import json_schema_spec

pytestmark = pytest.mark.slow

V = 49152
EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
ANSWER = '{"name": "Al", "n": 42}'


@pytest.fixture(scope="module")
def spec():
    return json_schema_spec(SCHEMA)


@pytest.fixture(scope="module")
def answer(encode) -> list[int]:
    return encode(ANSWER)


def fresh_mask(compiler, spec, prefix: list[int]) -> torch.Tensor:
    """[W] bitmask of a new state after ``prefix``, one token at a time."""
    state, mask = compiler.new_state(spec), new_bitmask(1, V)
    assert all(state.accept(t) for t in prefix)
    state.fill(mask, 0)
    return mask[0]


def drafts_of(rows: list[list[int]], gamma: int) -> torch.Tensor:
    return torch.tensor([r + [0] * (gamma - len(r)) for r in rows], dtype=torch.int64)


def test_verify_masks_follow_the_drafted_tokens(compiler, spec, answer):
    committed, block = answer[:2], answer[2:7]
    state = compiler.new_state(spec)
    assert all(state.accept(t) for t in committed)
    bitmask, rows = verify_bitmask([None, state], drafts_of([[5, 6], block], 5), [2, 5], V)
    assert bitmask.shape == (3 + 6, V // 32)
    assert rows == list(range(3, 9))
    assert bool((bitmask[:3] == -1).all())  # the unconstrained request is left alone
    for j in range(6):  # row j: after the committed output and drafts 1..j
        assert torch.equal(bitmask[3 + j], fresh_mask(compiler, spec, committed + block[:j])), j
    # the state is back at the committed output
    again = new_bitmask(1, V)
    state.fill(again, 0)
    assert torch.equal(again[0], fresh_mask(compiler, spec, committed))


def test_positions_after_a_forbidden_or_stop_draft_stay_open(compiler, spec, answer, encode):
    state = compiler.new_state(spec)
    forbidden = encode(" Sure")[0]
    block = answer[:2] + [forbidden] + answer[2:4]
    bitmask, rows = verify_bitmask([state], drafts_of([block], 5), [5], V)
    assert rows == [0, 1, 2]  # x_3 is forbidden after x_1 x_2: rejected for certain
    assert not bool(bitmask_to_bool(bitmask[2], V)[forbidden])
    assert bool((bitmask[3:] == -1).all())
    # a drafted stop token at the end of the JSON, then junk: no mask is filled after it
    state = compiler.new_state(spec)
    assert all(state.accept(t) for t in answer[:-1])
    bitmask, rows = verify_bitmask([state], drafts_of([[answer[-1], EOS, 7, 8]], 4), [4], V)
    assert rows == [0, 1]
    assert bitmask_to_bool(bitmask[1], V).nonzero().flatten().tolist() == [EOS]
    assert bool((bitmask[2:] == -1).all())
    assert not state.terminated


def test_mask_logits_sets_forbidden_tokens_to_minus_infinity(compiler, spec, tokenizer):
    logits = torch.randn(3, V)
    bitmask = new_bitmask(3, V)
    compiler.new_state(spec).fill(bitmask, 1)
    out = mask_logits(logits, bitmask, [1])
    allowed = bitmask_to_bool(bitmask[1], V)
    assert [tokenizer.decode([t]) for t in allowed.nonzero().flatten().tolist()] == ["{", '{"']
    assert torch.equal(out[1][allowed], logits[1][allowed])
    assert bool(torch.isneginf(out[1][~allowed]).all())
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    assert not bool(torch.isinf(logits).any())  # the input is untouched


def one_hot_block(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor([tokens], dtype=torch.int64)
    return t, torch.nn.functional.one_hot(t, V).float()


def test_unmasked_drafts_end_after_the_first_forbidden_one(compiler, spec, answer, encode):
    forbidden = encode(" Sure")[0]
    tokens, probs = one_hot_block(answer[:2] + [forbidden] + answer[2:4])
    before = (tokens.clone(), probs.clone())
    lengths = torch.tensor([5])
    constrain_drafts([compiler.new_state(spec)], tokens, probs, lengths, None)
    assert lengths.tolist() == [3]  # x_3 is still verified (and rejected for certain)
    assert torch.equal(tokens, before[0]) and torch.equal(probs, before[1])


def test_masked_drafts_stop_before_a_one_hot_forbidden_draft(compiler, spec, answer, encode):
    forbidden = encode(" Sure")[0]
    tokens, probs = one_hot_block(answer[:2] + [forbidden] + answer[2:4])
    lengths = torch.tensor([5])
    constrain_drafts([compiler.new_state(spec)], tokens, probs, lengths, torch.zeros(1, 5))
    assert lengths.tolist() == [2]


def test_drafts_end_at_a_drafted_stop_token(compiler, spec, answer):
    state = compiler.new_state(spec)
    assert all(state.accept(t) for t in answer[:-1])
    tokens, probs = one_hot_block([answer[-1], EOS, 5, 6])
    lengths = torch.tensor([4])
    constrain_drafts([state], tokens, probs, lengths, torch.zeros(1, 4))
    assert lengths.tolist() == [2]
    assert not state.terminated


def test_masked_draft_is_a_sample_of_the_masked_distribution(compiler, spec, answer, encode):
    """Keep an allowed draw, redraw a forbidden one: the result is distributed as the
    renormalised masked q (chi-square), and q is replaced by it."""
    state = compiler.new_state(spec)
    assert all(state.accept(t) for t in answer[:4])  # inside the "name" key's value
    candidates = [encode(s)[0] for s in ('"', "Al", "Bob", "Sure")] + [EOS, encode("\n")[0]]
    allowed = bitmask_to_bool(fresh_mask(compiler, spec, answer[:4]), V)[candidates]
    assert allowed.tolist() == [True, True, True, True, False, False]
    q = torch.zeros(V)
    q[candidates] = torch.tensor([0.1, 0.1, 0.2, 0.1, 0.3, 0.2])
    masked = q[candidates[:4]] / q[candidates[:4]].sum()
    g = torch.Generator().manual_seed(0)
    n, counts = 3000, np.zeros(4, dtype=np.int64)
    drawn = torch.multinomial(q, n, replacement=True, generator=g)
    uniforms = torch.rand(n, generator=g)
    for x, u in zip(drawn.tolist(), uniforms.tolist()):
        tokens, probs, lengths = torch.tensor([[x]]), q.clone().view(1, 1, V), torch.tensor([1])
        constrain_drafts([state], tokens, probs, lengths, torch.tensor([[u]]))
        assert lengths.tolist() == [1]
        counts[candidates.index(int(tokens[0, 0]))] += 1
        assert torch.allclose(probs[0, 0, candidates[:4]], masked)
        assert float(probs[0, 0].sum()) == pytest.approx(1.0)
    assert stats.chisquare(counts, masked.numpy() * n).pvalue > 1e-3
    # power: replacing a forbidden draw by the most likely allowed token instead is rejected
    assert stats.chisquare(counts, np.array([0.1, 0.1, 0.7, 0.1]) * n).pvalue < 1e-6
