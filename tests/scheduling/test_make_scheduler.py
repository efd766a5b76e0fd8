"""make_scheduler: names, required arguments, shared input checks, batch-token limits."""
import pytest
import torch

from dspark_serve.scheduling import (SCHEDULER_NAMES, Algorithm1Scheduler, AsyncScheduler,
                                     CostTable, StaticScheduler, ThresholdScheduler,
                                     make_scheduler)

TABLE = CostTable((1, 8, 64, 512), (100.0, 90.0, 40.0, 8.0), 4096)


def build(name, **kwargs):
    return make_scheduler(name, gamma=4, cost_table=TABLE, **kwargs)


def test_names():
    assert isinstance(build("algorithm1"), Algorithm1Scheduler)
    assert isinstance(build("async"), AsyncScheduler)
    assert isinstance(build("static"), StaticScheduler)
    threshold = build("threshold", threshold=0.3)
    assert isinstance(threshold, ThresholdScheduler) and threshold.threshold == 0.3
    with pytest.raises(ValueError, match="unknown scheduler 'greedy'"):
        build("greedy")
    for name in ("algorithm1", "async"):
        with pytest.raises(ValueError, match="needs a cost table"):
            make_scheduler(name, gamma=4)
    assert make_scheduler("static", gamma=4)(torch.ones(2, 4)).tolist() == [4, 4]


@pytest.mark.parametrize("kwargs, error", [
    (dict(gamma=0), ValueError),
    (dict(gamma=2.0), TypeError),
    (dict(gamma=4, max_batch_tokens=0), ValueError),
    (dict(gamma=4, max_batch_tokens=3.5), TypeError),
])
@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_bad_arguments(name, kwargs, error):
    with pytest.raises(error):
        make_scheduler(name, cost_table=TABLE, **kwargs)


def test_bad_threshold():
    with pytest.raises(ValueError, match="finite"):
        build("threshold", threshold=float("nan"))
    with pytest.raises(TypeError, match="number"):
        build("threshold", threshold="0.5")
    with pytest.raises(TypeError, match="CostTable"):
        make_scheduler("async", gamma=4, cost_table={"max_batch_tokens": 8})


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
@pytest.mark.parametrize("confidence, error, message", [
    (torch.ones(3, 4, dtype=torch.int64), TypeError, "floating-point"),
    (torch.ones(3, 5), ValueError, r"shape \[R, 4\]"),
    (torch.ones(4), ValueError, r"shape \[R, 4\]"),
    (torch.full((3, 4), 1.5), ValueError, r"\[0, 1\]"),
    (torch.full((3, 4), -0.1), ValueError, r"\[0, 1\]"),
    (torch.tensor([[0.5, float("nan"), 0.5, 0.5]]), ValueError, r"\[0, 1\]"),
])
def test_bad_confidence(name, confidence, error, message):
    with pytest.raises(error, match=message):
        build(name)(confidence)


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_lengths_are_valid_and_within_the_budget(name):
    gen = torch.Generator().manual_seed(4)
    for budget in (None, 40, 61, 200, 1000):
        sched = build(name, max_batch_tokens=budget)
        for _ in range(3):
            conf = torch.rand(40, 4, generator=gen).pow(0.3)
            lengths = sched(conf)
            assert lengths.dtype == torch.int64 and lengths.shape == (40,)
            assert int(lengths.min()) >= 0 and int(lengths.max()) <= 4
            if budget is not None:
                assert int((1 + lengths).sum()) <= budget
