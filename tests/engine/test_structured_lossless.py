"""Temperature-1 losslessness of grammar-constrained speculative decoding on the real model.

The output must match the regex ``[0-9]{2}``: two digit tokens, then EOS (the only token the
grammar allows after them). Its exact distribution is the product of the target's two
grammar-masked conditionals (softmax over the ten digit tokens), computed here by direct
target forwards; 600 samples per run (the engine's fixed seed) are binned into its 20 most likely outputs +
other. The oracle drafter proposes from q = uniform over the ten digits, nine letters and EOS,
so drafts are forbidden (letters, an early EOS), allowed and accepted, allowed and rejected,
and a drafted EOS after two digits is accepted. Both draft modes are checked: masked (q
restricted to the grammar, forbidden drafts redrawn) and as drafted (forbidden drafts rejected).

Bounds as in ``test_llm_engine_lossless.py``: every run's p-value against the exact
distribution > 1e-3, and an engine that redraws
forbidden drafts but rejection-tests them against the unmasked q must fail at p < 1e-3.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dspark_serve.engine.model_runner as model_runner
from dspark_serve.engine.params import SamplingParams
from dspark_serve.structured.masking import bitmask_to_bool, new_bitmask
from dspark_serve.structured.spec import regex_spec
from tests.engine.exact_distribution import goodness_of_fit, prefix_logits

pytestmark = [pytest.mark.slow, pytest.mark.lossless]

PROMPT = "My lucky number is "
SPEC = regex_spec("[0-9]{2}")
NUM_SAMPLES = 600
NUM_BINS = 20
P_MIN = 1e-3
PARAMS = SamplingParams(temperature=1.0, max_tokens=4, structured=SPEC)


@pytest.fixture(scope="module")
def engines(make_engine):
    """(plain, dspark masked drafts, dspark drafts as drafted): gamma 2, every draft verified."""
    sizes = dict(max_num_seqs=128, max_model_len=32)
    spec = dict(speculative="dspark", scheduler="static", gamma=2, **sizes)
    return (make_engine(speculative="none", **sizes), make_engine(**spec),
            make_engine(mask_drafts=False, **spec))


@pytest.fixture(scope="module")
def prompt_ids(engines) -> list[int]:
    return engines[0].tokenizer.encode(PROMPT, add_special_tokens=False)


@pytest.fixture(scope="module")
def digits(engines) -> list[int]:
    """The tokens the grammar allows first: exactly the ten digit tokens."""
    engine = engines[0]
    mask = new_bitmask(1, engine.vocab_size)
    engine.grammar_compiler().new_state(SPEC).fill(mask, 0)
    ids = bitmask_to_bool(mask[0], engine.vocab_size).nonzero().flatten().tolist()
    assert sorted(engine.tokenizer.decode([t]) for t in ids) == list("0123456789")
    return ids


@pytest.fixture(scope="module")
def exact(engines, prompt_ids, digits) -> dict[tuple[int, ...], float]:
    """Probability of every output (d1, d2, EOS) under the masked target at temperature 1."""
    target, eos = engines[0].target, min(engines[0].eos_ids)
    prefixes = [()] + [(d,) for d in digits]
    logits = prefix_logits(target, prompt_ids, prefixes, 2).double()
    masked = {p: torch.softmax(row[digits], dim=-1) for p, row in zip(prefixes, logits)}
    out = {(d1, d2, eos): float(masked[()][i] * masked[(d1,)][j])
           for i, d1 in enumerate(digits) for j, d2 in enumerate(digits)}
    assert abs(sum(out.values()) - 1.0) < 1e-6
    return out


@pytest.fixture(scope="module")
def bins(exact) -> list[tuple[int, ...]]:
    return sorted(exact, key=exact.get, reverse=True)[:NUM_BINS]


def draft_distribution(engine, digits):
    letters = [engine.tokenizer.encode(c, add_special_tokens=False)[0] for c in "abcdefghi"]
    q = torch.zeros(engine.vocab_size)
    q[digits + letters + [min(engine.eos_ids)]] = 1.0 / 20
    return lambda prefix: q


def draw(engine, generate, prompt_ids) -> tuple[list[tuple[int, ...]], float]:
    out = generate(engine, {f"s{i}": prompt_ids for i in range(NUM_SAMPLES)}, PARAMS)
    assert all(c.finish_reason == "stop" for c in out.values())
    tau = float(np.mean([c.accepted_length for c in out.values()]))
    return [tuple(c.token_ids) for c in out.values()], tau


def test_plain_constrained_sampling_matches_exact(engines, generate, prompt_ids, exact, bins):
    samples, _ = draw(engines[0], generate, prompt_ids)
    assert goodness_of_fit(samples, exact, bins) > P_MIN


@pytest.mark.parametrize("masked", [True, False], ids=["masked-drafts", "drafts-as-drafted"])
def test_speculative_constrained_sampling_matches_exact(masked, engines, generate, prompt_ids,
                                                        digits, exact, bins,
                                                        distribution_oracle, use_oracle):
    engine = engines[1 if masked else 2]
    use_oracle(engine, distribution_oracle(engine, draft_distribution(engine, digits), seed=7))
    samples, tau = draw(engine, generate, prompt_ids)
    assert 1.1 < tau < 2.9, tau  # drafts accepted and rejected
    assert goodness_of_fit(samples, exact, bins) > P_MIN


def _keep_unmasked_probs(constrain_drafts):
    """A broken draft projection: forbidden drafts are redrawn from the masked q, but the
    verifier still sees the unmasked q (so it accepts them twice as readily)."""
    def broken(states, tokens, probs, lengths, uniforms):
        unmasked = probs.clone()
        constrain_drafts(states, tokens, probs, lengths, uniforms)
        probs.copy_(unmasked)
    return broken


def test_broken_draft_projection_is_detected(engines, generate, prompt_ids, digits, exact,
                                             bins, distribution_oracle, use_oracle,
                                             monkeypatch):
    engine = engines[1]
    use_oracle(engine, distribution_oracle(engine, draft_distribution(engine, digits), seed=8))
    monkeypatch.setattr(model_runner, "constrain_drafts",
                        _keep_unmasked_probs(model_runner.constrain_drafts))
    samples, _ = draw(engine, generate, prompt_ids)
    assert goodness_of_fit(samples, exact, bins) < P_MIN
