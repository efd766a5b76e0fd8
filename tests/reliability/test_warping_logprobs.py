"""top-k / top-p / min-p act on the target distribution in verification, and logprobs under
speculation equal those of plain decoding.

The warping test uses the oracle in "adversarial" mode: at every known history it proposes
the most probable target token that the request's filter excludes, so a verifier that accepted
drafts against the unfiltered target distribution would emit it often. Every returned token
(speculative and plain, unseeded and seeded) is checked against the filter's allowed set,
computed from the plain server's top-20 logprobs for exactly that prefix.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
PROMPT = "The best way to spend a rainy afternoon is"
FILTERS = [{"top_p": 0.3}, {"top_k": 2}, {"min_p": 0.3}]
LOGPROB_TOL = 1e-4


@pytest.mark.parametrize("warp", FILTERS, ids=lambda w: next(iter(w)))
def test_filters_applied_in_verification(ref_server, spec_server, oracle_mode, nucleus, warp):
    ref_server.complete({"prompt": PROMPT, "temperature": 0, "max_tokens": 8, "logprobs": 20})
    request = {"prompt": PROMPT, "temperature": 1.0, "n": 12, "max_tokens": 8, **warp}
    proposed = spec_server.oracle.proposed
    with oracle_mode("adversarial"):
        spec = [spec_server.complete(request), spec_server.complete({**request, "seed": 5})]
    assert spec_server.oracle.proposed - proposed >= 12, "the adversary proposed too little"
    ref = ref_server.complete(request)
    prompt = ref_server.recorder.choice_prompt(ref)
    samples = [s for b in spec for s in spec_server.recorder.choice_tokens(b)]
    samples += ref_server.recorder.choice_tokens(ref)
    prefixes = sorted({tuple(s[:i]) for s in samples for i in range(len(s))})
    queries = ref_server.complete_many(
        [{"prompt": prompt + list(p), "temperature": 0, "max_tokens": 1, "logprobs": 20}
         for p in prefixes], concurrency=12)
    allowed, undecided = {}, 0
    for p, q in zip(prefixes, queries):
        top = ref_server.recorder.top[ref_server.recorder.request_ids(q)[0]][0]
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        keep = nucleus(ranked, warp.get("top_k", 0), warp.get("top_p", 1.0),
                       warp.get("min_p", 0.0))
        allowed[p] = {t for t, _ in ranked[:keep]} if keep is not None else None
    for s in samples:
        for i, token in enumerate(s):
            if allowed[tuple(s[:i])] is None:
                undecided += 1
                continue
            assert token in allowed[tuple(s[:i])], (warp, s, i)
    assert undecided <= sum(map(len, samples)) // 10


def test_logprobs_equal_plain_decoding(ref_server, spec_server, oracle_mode):
    """Greedy and seeded requests return the same tokens with and without speculation, so their
    logprobs and top_logprobs must agree (within float32 noise of different batch shapes)."""
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers."]
    bodies = [{"messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 16,
               "logprobs": True, "top_logprobs": 5} for q in questions]
    bodies.append({**bodies[1], "temperature": 1.0, "seed": 11, "frequency_penalty": 0.5})
    ref = ref_server.complete_many(bodies, concurrency=len(bodies), path=CHAT)
    with oracle_mode("mixed"):
        spec = spec_server.complete_many(bodies, concurrency=len(bodies), path=CHAT)
    assert sum(b["dspark"]["accepted_tokens"] for b in spec) > 0
    for r, s in zip(ref, spec):
        assert spec_server.recorder.choice_tokens(s) == ref_server.recorder.choice_tokens(r)
        rc, sc = r["choices"][0]["logprobs"]["content"], s["choices"][0]["logprobs"]["content"]
        assert len(rc) == len(sc) == r["usage"]["completion_tokens"]
        for re_, se in zip(rc, sc):
            assert se["token"] == re_["token"]
            assert abs(se["logprob"] - re_["logprob"]) <= LOGPROB_TOL
        rtops = ref_server.recorder.top[ref_server.recorder.request_ids(r)[0]]
        stops = spec_server.recorder.top[spec_server.recorder.request_ids(s)[0]]
        for rtop, stop in zip(rtops, stops, strict=True):
            shared = rtop.keys() & stop.keys()
            assert len(rtop) == len(stop) == 5 and len(shared) >= 4
            if len(shared) == 4:  # only a near-tie at rank 5 may swap the last entry
                (a,), (b,) = rtop.keys() - shared, stop.keys() - shared
                assert abs(rtop[a] - stop[b]) <= LOGPROB_TOL
            assert all(abs(rtop[t] - stop[t]) <= LOGPROB_TOL for t in shared)
