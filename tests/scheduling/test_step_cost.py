"""Served step times correcting the profiled SPS(B) (``scheduling.step_cost``)."""
import pytest
import torch

from dspark_serve.scheduling import CostTable, make_scheduler
from dspark_serve.scheduling.step_cost import REPRICE_REL, STEP_TIME_EMA, MeasuredStepCost

# profiled: 10 ms at B = 1..2, 20 ms at B = 3..4, limit 6 (20 ms * 4 / B beyond the last probe)
TABLE = CostTable((2, 4), (100.0, 50.0), 6)


def test_prices_are_the_profile_until_a_step_is_served():
    cost = MeasuredStepCost(TABLE)
    assert torch.equal(cost.sps_range(1, 9), TABLE.sps_range(1, 9))
    assert cost.ratio(3) == 1.0 and cost.version == 0 and cost.max_batch_tokens == 6


def test_ratios_interpolate_between_served_batch_sizes_and_hold_outside():
    cost = MeasuredStepCost(TABLE)
    cost.observe(2, 0.015)                  # 1.5x the profiled 10 ms
    cost.observe(4, 0.040)                  # 2.0x the profiled 20 ms
    assert [cost.ratio(b) for b in (1, 2, 3, 4, 6)] == pytest.approx([1.5, 1.5, 1.75, 2.0, 2.0])
    expected = torch.tensor([100 / 1.5, 100 / 1.5, 50 / 1.75, 50 / 2.0, 40 / 2.0, 100 / 3 / 2.0,
                             0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(cost.sps_range(1, 9), expected)   # 0 above the limit stays 0
    assert torch.allclose(cost.sps_range(3, 5), expected[2:4])


def test_a_batch_size_never_costs_more_than_a_larger_one():
    """Served times that make B = 3 slower than B = 4 (one slow step among few) give every
    B <= 4 the price of B = 4: SPS non-increasing in B."""
    cost = MeasuredStepCost(TABLE)
    cost.observe(3, 0.050)                  # 2.5x the profiled 20 ms
    cost.observe(4, 0.020)                  # 1.0x
    # unclamped: 100 / 2.5, 100 / 2.5, 50 / 2.5, 50, 40, 100 / 3 (ratio 1 above B = 4)
    expected = torch.tensor([50.0, 50.0, 50.0, 50.0, 40.0, 100 / 3, 0.0, 0.0],
                            dtype=torch.float64)
    assert torch.allclose(cost.sps_range(1, 9), expected)
    assert torch.allclose(cost.sps_range(5, 7), expected[4:6])


def test_moving_average_and_repricing_threshold():
    cost = MeasuredStepCost(TABLE)
    cost.observe(2, 0.015)
    assert cost.version == 1
    cost.observe(2, 0.005)                  # ratio 1.5 -> 1.4: moved > REPRICE_REL, repriced
    assert cost.ratio(2) == pytest.approx(1.5 + STEP_TIME_EMA * (0.5 - 1.5))
    assert cost.version == 2
    small = 1.4 * (1 + REPRICE_REL / 2 / STEP_TIME_EMA)   # moves the average by REPRICE_REL / 2
    cost.observe(2, small * 0.010)
    assert cost.version == 2 and cost.ratio(2) == pytest.approx(1.4)   # prices kept
    assert torch.allclose(cost.sps_range(2, 3), torch.tensor([100 / 1.4], dtype=torch.float64))


@pytest.mark.parametrize("b,seconds", [(0, 0.01), (7, 0.01), (2, 0.0), (2, -1.0)])
def test_ignores_steps_it_cannot_price(b, seconds):
    cost = MeasuredStepCost(TABLE)
    cost.observe(b, seconds)
    assert cost.version == 0 and cost.ratio(2) == 1.0


def test_rejects_a_non_table():
    with pytest.raises(TypeError, match="CostTable"):
        MeasuredStepCost({"B": 1})


def test_served_steps_stop_drafting_a_profile_made_look_free():
    """The profile says a 2-token verify costs what a plain step costs; served steps say 1.5x:
    drafting one token at survival 0.3 then loses (1.3 / 1.5 < 1) and stops."""
    table = CostTable((1, 2, 3), (100.0, 100.0, 100.0), 3)
    sched = make_scheduler("async", gamma=2, cost_table=table)
    for _ in range(2):
        sched(torch.tensor([[0.3, 0.1]]))
    sched.observe_draft(1, 0.0)
    assert sched.worth_drafting(1) and sched.capacity(1) == 2
    sched.observe_step(1, 0.010)
    sched.observe_step(2, 0.015)
    sched.observe_step(3, 0.020)
    assert sched.capacity(1) == 0
    assert not sched.worth_drafting(1)
    sched.reset()                          # a new run forgets the served times too
    assert sched.step_cost.version == 0
