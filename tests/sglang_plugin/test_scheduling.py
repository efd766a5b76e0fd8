"""Scheduler adapter for SGLang's DSPARK planner (pure PyTorch, no sglang needed)."""
import pytest
import torch

from dspark_serve.scheduling.cost_table import CostTable
from dspark_serve.sglang_plugin.scheduling import (LaggedBudgetPlanner, capacity_from_lagged,
                                                   verify_lens_from_confidence)

# Flat SPS up to B = 4, then a cliff: 100 steps/s for B <= 4, 40 steps/s for 5 <= B <= 8.
TABLE = CostTable((4, 8), (100.0, 40.0), 8)


def test_capacity_uses_lagged_survival_and_conservative_sps():
    # R = 2, gamma = 3. Survival row0: .9 .81 .729, row1: .5 .25 .125.
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.5, 0.5, 0.5]])
    d = capacity_from_lagged(conf, torch.tensor([True, True]), TABLE)
    # k=2 (B=4): (2 + .9 + .81) * 100 = 371; any k>=3 has B>=5 -> SPS 40, at most
    # (2 + 3.314) * 40 < 371.
    assert d.budget == 2
    assert d.predicted_theta == pytest.approx(371.0)
    assert d.predicted_step_seconds == pytest.approx(0.01)


def test_capacity_without_history_assumes_survival():
    conf = torch.zeros(2, 3)
    # No history: every slot survives, Theta_k = (2 + k) * SPS(2 + k): k=2 -> 400 beats
    # k=6 -> 8 * 40 = 320. With history of zeros no slot is admissible: K = 0.
    assert capacity_from_lagged(conf, torch.tensor([False, False]), TABLE).budget == 2
    assert capacity_from_lagged(conf, torch.tensor([True, True]), TABLE).budget == 0


def test_capacity_rejects_bad_input():
    with pytest.raises(ValueError):
        capacity_from_lagged(torch.ones(2, 3), torch.tensor([True]), TABLE)
    with pytest.raises(ValueError):
        capacity_from_lagged(torch.ones(9, 3), torch.ones(9, dtype=torch.bool), TABLE)


def test_verify_lens_top_k_prefixes_and_caps():
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.95, 0.1, 0.9], [0.0, 1.0, 1.0]])
    # Survival: r0 .9 .81 .729; r1 .95 .095 .0855; r2 0 0 0 (never admitted).
    lens = verify_lens_from_confidence(conf, 3)
    assert lens.dtype == torch.int32
    assert lens.tolist() == [3, 2, 1]            # slots r1j1 (.95), r0j1 (.9), r0j2 (.81)
    assert verify_lens_from_confidence(conf, 100).tolist() == [4, 4, 1]
    caps = torch.tensor([1, 3, 3])
    assert verify_lens_from_confidence(conf, 3, caps).tolist() == [2, 3, 1]
    assert verify_lens_from_confidence(conf, 0).tolist() == [1, 1, 1]
    with pytest.raises(ValueError):
        verify_lens_from_confidence(conf, -1)


def test_verify_lens_give_a_valid_ragged_layout():
    """Budget invariant SGLang's planner asserts: sum(verify_len - 1) <= K, 1 <= len <= gamma+1;
    and the layout SGLang builds from them has one row per request."""
    ragged = pytest.importorskip("sglang.srt.speculative.ragged_verify",
                                 reason="sglang not installed (pip install 'dspark-serve[sglang]')")
    gen = torch.Generator().manual_seed(0)
    conf = torch.rand(6, 4, generator=gen)
    for k in (0, 5, 24):
        lens = verify_lens_from_confidence(conf, k)
        assert int((lens - 1).sum()) <= k and int(lens.min()) >= 1 and int(lens.max()) <= 5
        layout = ragged.RaggedVerifyLayout.from_verify_lens(
            verify_lens_cpu=lens.tolist(), device=torch.device("cpu"), grid=[8, 16, 32])
        assert layout.verify_lens.tolist() == lens.tolist()


def test_planner_carries_two_steps_without_relay_lag():
    planner = LaggedBudgetPlanner(TABLE, 3, relay_lag_steps=0)
    rows, gen = torch.tensor([0, 1]), torch.tensor([1, 1])
    low = torch.full((2, 3), 0.01)
    high = torch.full((2, 3), 0.99)
    # Steps 1 and 2 have no step t-2: all-survive assumption, K = 2 (see above).
    assert planner.compute_budget(confidence=low, generation=gen, current_generation=gen,
                                  req_pool_indices_cpu=rows) == 2
    assert planner.compute_budget(confidence=high, generation=gen, current_generation=gen,
                                  req_pool_indices_cpu=rows) == 2
    # Step 3 uses step 1's low survival (.01 at slot 1 of each row): within B <= 4,
    # Theta_k = (2 + S_k) * 100 grows to k=2 (202); k >= 3 pays SPS 40.
    k3 = planner.compute_budget(confidence=high, generation=gen, current_generation=gen,
                                req_pool_indices_cpu=rows)
    assert k3 == 2 and planner.take_last_decision().predicted_theta == pytest.approx(
        (2 + 0.01 + 0.01) * 100)
    assert planner.take_last_decision() is None
    # A reused pool slot (generation changed) has no history: all-survive again.
    k4 = planner.compute_budget(confidence=high, generation=gen, current_generation=gen + 1,
                                req_pool_indices_cpu=rows)
    assert k4 == 2 and planner.last_decision.predicted_theta == pytest.approx(400.0)


def test_planner_with_relay_lag_uses_relayed_rows_directly():
    planner = LaggedBudgetPlanner(TABLE, 3, relay_lag_steps=2)
    gen, rows, zeros = torch.tensor([1, 1]), torch.tensor([3, 4]), torch.zeros(2, 3)
    # The relay has written a request's row only after its first relay_lag decode steps:
    # until then all-survive (K = 2); from the third step its zero survival gives K = 0.
    budgets = [planner.compute_budget(confidence=zeros, generation=gen, current_generation=gen,
                                      req_pool_indices_cpu=rows) for _ in range(3)]
    assert budgets == [2, 2, 0] and planner.carry_steps == 0


def test_capacity_treats_non_confidence_rows_as_no_history():
    # Row 1 holds what SGLang's uninitialised relay buffer handed back (values seen in a
    # real run): it must count as surviving everywhere, exactly like a row without history.
    garbage = torch.tensor([[1.9e31, -1.6e-22, float("nan")], [float("inf"), 0.5, 0.5],
                            [-0.1, 0.5, 0.5], [0.5, 0.5, 1.0001]])
    history = torch.tensor([True, True])
    for bad in garbage:
        conf = torch.stack([torch.tensor([0.5, 0.5, 0.5]), bad])
        expected = capacity_from_lagged(conf, torch.tensor([True, False]), TABLE)
        got = capacity_from_lagged(conf, history, TABLE)
        assert (got.budget, got.predicted_theta) == (expected.budget, expected.predicted_theta)
    # Row 1 without history: its two first slots (survival 1) rank first, (2 + 1 + 1) * 100 at
    # k = 2 (B = 4) beats everything with B >= 5.
    assert expected.budget == 2 and expected.predicted_theta == pytest.approx(400.0)
    with pytest.raises(TypeError):
        capacity_from_lagged(torch.ones(2, 3, dtype=torch.int64), history, TABLE)


def test_request_joining_a_running_overlap_batch_gets_no_history():
    """Regression (issue 17): compact mode with the overlap scheduler; a third request joins
    two running ones and SGLang's relay hands back its never-written row (garbage, or zeros)
    with the current generation. The planner used to raise ValueError and kill the scheduler."""
    planner = LaggedBudgetPlanner(TABLE, 3, relay_lag_steps=2)
    low = torch.full((2, 3), 0.01)
    for _ in range(3):      # two running requests, long enough to have relayed history
        planner.compute_budget(confidence=low, generation=torch.tensor([1, 1]),
                               current_generation=torch.tensor([1, 1]),
                               req_pool_indices_cpu=torch.tensor([0, 1]))
    gen = torch.tensor([1, 1, 1])
    rows = torch.tensor([0, 1, 2])
    for unwritten in ([1.9e31, -1.6e-22, 0.3], [0.0, 0.0, 0.0]):
        conf = torch.cat([low, torch.tensor([unwritten])])
        k = planner.compute_budget(confidence=conf, generation=gen, current_generation=gen,
                                   req_pool_indices_cpu=rows)
        # Joined request surviving everywhere: Theta_k = (3 + k) * 100 for B = 3 + k <= 4,
        # so k = 1 (400) beats k = 0 (300) and any B >= 5 (at most (3 + 5.03) * 40).
        assert k == 1 and planner.take_last_decision().predicted_theta == pytest.approx(400.0)
    # Its own relayed rows count from its third decode step on.
    k = planner.compute_budget(confidence=torch.full((3, 3), 0.01), generation=gen,
                               current_generation=gen, req_pool_indices_cpu=rows)
    assert k == 1 and planner.take_last_decision().predicted_theta == pytest.approx(301.0)
