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
    gen = torch.tensor([1, 1])
    k = planner.compute_budget(confidence=torch.zeros(2, 3), generation=gen,
                               current_generation=gen, req_pool_indices_cpu=torch.tensor([3, 4]))
    assert k == 0 and planner.carry_steps == 0
