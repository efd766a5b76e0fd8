"""Seeded sampling is reproducible across runs, batch compositions and speculation, and n > 1
returns n independent samples (choice i of a seeded request is the request with seed + i)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village,"
OTHERS = ["The weather today", "def fibonacci(n):", "My favourite food is", "In 1969,",
          "The quick brown fox", "Water boils at", "A good password", "Dear diary,",
          "The mitochondria is", "Roses are red,", "SELECT * FROM"]


def seeded(seed: int, **params) -> dict:
    return {"prompt": PROMPT, "temperature": 0.9, "top_p": 0.95, "max_tokens": 12,
            "seed": seed, **params}


def test_seeded_reproducible_across_runs_batches_and_speculation(ref_server, spec_server):
    ref_server.complete({**seeded(0), "temperature": 0})  # the oracle learns the greedy path
    alone = [s.recorder.choice_tokens(s.complete(seeded(77)))[0]
             for s in (ref_server, spec_server)]
    assert alone[0] == alone[1]
    for server in (ref_server, spec_server):
        # the same request again, batched with 11 others of different lengths and parameters
        crowd = [{"prompt": p, "max_tokens": 4 + 2 * i, "temperature": 1.0} for i, p in
                 enumerate(OTHERS)]
        bodies = crowd[:5] + [seeded(77)] + crowd[5:]
        batched = server.complete_many(bodies, concurrency=len(bodies))[5]
        assert server.recorder.choice_tokens(batched)[0] == alone[0], server.name
        again = server.complete(seeded(77))
        assert server.recorder.choice_tokens(again)[0] == alone[0], server.name
    other = ref_server.recorder.choice_tokens(ref_server.complete(seeded(78)))[0]
    assert other != alone[0], "the seed has no effect"


def test_n_choices_are_independent_samples(server):
    n = 6
    body = server.complete(seeded(500, n=n))
    choices = server.recorder.choice_tokens(body)
    assert [c["index"] for c in body["choices"]] == list(range(n))
    singles = server.complete_many([seeded(500 + i) for i in range(n)], concurrency=n)
    assert choices == [server.recorder.choice_tokens(b)[0] for b in singles]
    assert len({tuple(c) for c in choices}) >= n - 1, "seeded choices are not independent"
    unseeded = server.complete({**seeded(0, n=n), "seed": None})
    texts = [c["text"] for c in unseeded["choices"]]
    assert len(set(texts)) >= n - 1, f"unseeded choices look dependent: {texts}"
    assert body["usage"]["completion_tokens"] == sum(map(len, choices))
