"""Verbatim copying of opaque identifiers (random hex strings, mixed-case tokens): 200 greedy
requests at concurrency 12 return exactly the same tokens and text with and without
speculation. Copying is where drafters are most confident and blocks are longest, so a verify
forward whose logits depend on the batch shape, or a commit that mishandles a long accepted
block, shows up here as a changed identifier."""
from __future__ import annotations

import random
import string

import pytest

pytestmark = pytest.mark.slow

NUM_REQUESTS = 200
CONCURRENCY = 12
FEW_SHOT = "b71e = b71e\nQx7L = Qx7L\n{} ="  # ~30 tokens; the model copies ~90% of codes


def identifiers(n: int, seed: int = 6) -> list[str]:
    """Alternating random lowercase hex strings and mixed-case alphanumerics, 6..10 chars."""
    rng = random.Random(seed)
    alphabets = ("0123456789abcdef", string.ascii_letters + string.digits)
    return ["".join(rng.choice(alphabets[i % 2]) for _ in range(rng.randint(6, 10)))
            for i in range(n)]


def test_copying_identical_with_and_without_speculation(ref_server, spec_server, oracle_mode):
    codes = identifiers(NUM_REQUESTS)
    bodies = [{"prompt": FEW_SHOT.format(c), "temperature": 0, "max_tokens": 10, "stop": ["\n"]}
              for c in codes]
    ref = ref_server.complete_many(bodies, CONCURRENCY)
    with oracle_mode("mixed"):
        spec = spec_server.complete_many(bodies, CONCURRENCY)
    for r, s in zip(ref, spec):
        assert spec_server.recorder.choice_tokens(s) == ref_server.recorder.choice_tokens(r)
        assert s["choices"][0]["text"] == r["choices"][0]["text"]
        assert s["choices"][0]["finish_reason"] == r["choices"][0]["finish_reason"]
    copied = sum(r["choices"][0]["text"].strip() == c for r, c in zip(ref, codes))
    assert copied >= NUM_REQUESTS // 2, f"the prompt elicits copying in only {copied} cases"
    assert sum(s["dspark"]["accepted_tokens"] for s in spec) >= NUM_REQUESTS
