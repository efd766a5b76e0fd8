"""Workload: output lengths from references, log-normal lengths without, think time,
determinism per seed, input checks."""
from __future__ import annotations

import random
import statistics

import pytest

from dspark_serve.data.prompt_sets import PromptRecord
from dspark_serve.loadtest.workload import THINK_CAP_FACTOR, Workload


def _workload(**kwargs) -> Workload:
    sets = {"a": [PromptRecord("p1", "x" * 400), PromptRecord("p2", "y" * 20)],
            "b": [PromptRecord("q1")]}
    return Workload(sets, **{"max_tokens": 64, "min_tokens": 8, **kwargs})


def test_output_tokens_from_reference():
    w, rng = _workload(), random.Random(0)
    assert w.output_tokens(PromptRecord("p", "x" * 200), rng) == 50       # 200 chars / 4
    assert w.output_tokens(PromptRecord("p", "x" * 4000), rng) == 64      # capped
    assert w.output_tokens(PromptRecord("p", "x" * 8), rng) == 8          # floored


def test_output_tokens_without_reference():
    w, rng = _workload(max_tokens=1000, min_tokens=1), random.Random(1)
    draws = [w.output_tokens(PromptRecord("p"), rng) for _ in range(4000)]
    # log-normal with median 0.6 * cap: the sample median lies within 5% of 600
    assert 570 <= statistics.median(draws) <= 630
    assert min(draws) >= 1 and max(draws) <= 1000


def test_sample_is_seeded_and_covers_sets():
    w = _workload()
    a = [w.sample(random.Random(7)) for _ in range(3)]
    b = [w.sample(random.Random(7)) for _ in range(3)]
    assert a == b
    rng = random.Random(3)
    items = [w.sample(rng) for _ in range(400)]
    assert {i.prompt_set for i in items} == {"a", "b"}
    assert all(i.max_tokens == {"p1": 64, "p2": 8}.get(i.prompt, i.max_tokens) for i in items)


def test_think_time():
    w, rng = _workload(think_time_s=0.5), random.Random(2)
    draws = [w.think_time(rng) for _ in range(5000)]
    assert max(draws) <= THINK_CAP_FACTOR * 0.5
    assert 0.45 <= statistics.fmean(draws) <= 0.52  # exponential mean 0.5, slightly cut by the cap
    assert _workload(think_time_s=0).think_time(rng) == 0.0


@pytest.mark.parametrize("kwargs", [{"max_tokens": 4, "min_tokens": 8}, {"min_tokens": 0},
                                    {"think_time_s": -1.0}])
def test_bad_bounds(kwargs):
    with pytest.raises(ValueError):
        _workload(**kwargs)


def test_empty_set_and_unknown_name():
    with pytest.raises(ValueError, match="at least one prompt"):
        Workload({"a": []})
    with pytest.raises(ValueError, match="unknown prompt sets"):
        Workload.from_names(["mtbench", "gsm8k"])


def test_from_names_filters_long_prompts():
    w = Workload.from_names(["mtbench"], max_prompt_chars=100)
    assert 0 < len(w.sets["mtbench"]) < 80
    assert all(len(r.prompt) <= 100 for r in w.sets["mtbench"])
