"""Prompt-lookup survival table: fit by hand-counted rounds, lookup by match length, file round
trip, the served-outcome update, and the greedy replay that produces its rounds."""
import numpy as np
import pytest
import torch

from dspark_serve.calibration.lookup import (SHIFT_SD, LookupCalibration, OnlineLookupSurvival,
                                             fit_lookup_calibration)
from dspark_serve.eval.lookup_rounds import greedy_lookup_rounds


def test_fit_counts_reached_and_accepted_positions():
    # rounds (m, drafted, accepted): (1, 3, 0), (1, 3, 2), (2, 2, 2), (5, 3, 1)
    cal = fit_lookup_calibration(np.array([1, 1, 2, 5]), np.array([3, 3, 2, 3]),
                                 np.array([0, 2, 2, 1]), gamma=3, max_match=2)
    # m = 1: position 1 reached 2x accepted 1x; position 2 reached 1x accepted 1x;
    # position 3 reached 1x (drafted 3, accepted 2) accepted 0x.  Laplace: (a + 1) / (r + 2)
    assert cal.conditional[0] == pytest.approx([2 / 4, 2 / 3, 1 / 3], abs=1e-4)   # 4 decimals
    # m >= 2 (2 and 5 pooled): position 1 reached 2x accepted 2x; position 2 reached 2x
    # (drafted 2 and 3, both accepted 1) accepted 1x (the m = 2 round); position 3 unseen.
    assert cal.conditional[1] == pytest.approx([3 / 4, 2 / 4, 1 / 2], abs=1e-4)
    assert cal.num_rounds == 4
    with pytest.raises(ValueError, match="accepted <= drafted"):
        fit_lookup_calibration(np.array([1]), np.array([1]), np.array([2]), 3, 2)


def test_confidence_by_match_length_and_file_round_trip(tmp_path):
    cal = LookupCalibration([[0.5, 0.6], [0.7, 0.8]], dataset="x", num_rounds=3)
    c = cal.confidence(torch.tensor([0, 1, 2, 9]), gamma=2)
    assert c.tolist() == [[0.0, 0.0], pytest.approx([0.5, 0.6]), pytest.approx([0.7, 0.8]),
                          pytest.approx([0.7, 0.8])]
    cal.save(tmp_path / "t.json")
    assert LookupCalibration.load(tmp_path / "t.json") == cal
    with pytest.raises(ValueError, match="covers 2 positions"):
        cal.confidence(torch.tensor([1]), gamma=3)
    (tmp_path / "bad.json").write_text('{"conditional": [[1.5]]}')
    with pytest.raises(ValueError, match="values in"):
        LookupCalibration.load(tmp_path / "bad.json")


def _map_shift(prior_logit, reached, accepted, sd):
    """The MAP logit shift by bisection (the score is decreasing in b)."""
    def score(b):
        return accepted.sum() - (reached / (1 + np.exp(-(prior_logit + b)))).sum() - b / sd ** 2

    lo, hi = -20.0, 20.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if score(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def test_online_survival_moves_from_the_prior_to_served_outcomes():
    online = OnlineLookupSurvival([[0.5, 0.5], [0.9, 0.8]], prior_rounds=20)
    assert online.confidence(torch.tensor([0, 2]), 2).tolist() == [[0.0, 0.0],
                                                                   pytest.approx([0.9, 0.8])]
    # 10 served rounds at match 3 (pooled into the last row), 2 verified, none accepted:
    # position 1 reached 10x accepted 0x; position 2 unreached
    online.observe(np.full(10, 3), np.full(10, 2), np.zeros(10, dtype=int))
    # 5 rounds at match 1, 1 verified and accepted: position 1 reached 5x accepted 5x
    online.observe(np.ones(5, dtype=int), np.ones(5, dtype=int), np.ones(5, dtype=int))
    logit = np.log([[1.0, 1.0], [9.0, 4.0]])                # logit of the prior table
    b = _map_shift(logit, np.array([[5, 0], [10, 0]]), np.array([[5, 0], [0, 0]]), SHIFT_SD)
    assert online.shift == pytest.approx(b, abs=1e-6) and b < 0    # 5 of 15 accepted, 0.77 expected
    shifted = 1 / (1 + np.exp(-(logit + b)))
    # each cell: (20 * shifted + accepted) / (20 + reached); unreached cells follow the shift
    c = online.confidence(torch.tensor([1, 2]), 2)
    assert c.tolist() == [pytest.approx([(20 * shifted[0, 0] + 5) / 25, shifted[0, 1]], abs=1e-6),
                          pytest.approx([20 * shifted[1, 0] / 30, shifted[1, 1]], abs=1e-6)]
    with pytest.raises(ValueError, match="accepted <= drafted"):
        online.observe(np.array([1]), np.array([1]), np.array([2]))
    with pytest.raises(ValueError, match="prior_rounds"):
        OnlineLookupSurvival([[0.5]], prior_rounds=0)
    with pytest.raises(ValueError, match="values in"):
        OnlineLookupSurvival([[1.5]])


def test_a_traffic_that_accepts_less_lowers_the_cells_it_has_not_reached():
    # the prior says 0.8 everywhere; served rounds at match 1 accept 1 in 5 at position 1
    online = OnlineLookupSurvival([[0.8, 0.8], [0.8, 0.8]], prior_rounds=20)
    accepted = np.zeros(500, dtype=int)
    accepted[::5] = 1
    online.observe(np.ones(500, dtype=int), np.ones(500, dtype=int), accepted)
    table = online.table().numpy()
    # with 500 outcomes the shift's prior barely counts: the shifted prior is close to 0.2,
    # the data's rate (MAP within 0.01 of it: 500 * p(1 - p) = 80 against 1 / SHIFT_SD^2 = 1)
    assert table[1, 0] == pytest.approx(0.2, abs=0.01)
    assert table[0, 1] == table[1, 0] == table[1, 1]
    # the reached cell: (20 * shifted + 100) / 520, the shifted prior and the data agree
    assert table[0, 0] == pytest.approx((20 * table[1, 0] + 100) / 520, abs=1e-6)


def test_greedy_rounds_walk_p_to_p_plus_n_plus_1():
    # anchor 1 (pos 4): match [1] at 0 -> drafts 2 3 4, all accepted -> next anchor at 8
    # anchor 1 (pos 8): match [1 2 3 4 1] at 4 -> drafts 2 3 4 vs 2 3 9: 2 accepted
    m, d, a = greedy_lookup_rounds([1, 2, 3, 4], [1, 2, 3, 4, 1, 2, 3, 9], gamma=3)
    assert (m, d, a) == ([1, 5], [3, 3], [3, 2])
    # no earlier occurrence of the anchor: a round without drafts
    assert greedy_lookup_rounds([5], [6, 7], gamma=3) == ([0], [0], [0])


@pytest.mark.parametrize("prior,expected", [
    ([[0.5, 0.5, 0.5], [0.9, 0.8, 0.7]], [0.9, 0.8, 0.7]),        # one row dominates
    # rows cross: a = (0.5, 0.5, 0.5) and (0.9, 0.27, 0.081) -> max (0.9, 0.5, 0.5)
    ([[0.5, 1.0, 1.0], [0.9, 0.3, 0.3]], [0.9, 0.5 / 0.9, 1.0]),
])
def test_best_case_survival_bounds_every_match_length(prior, expected):
    best = OnlineLookupSurvival(prior).best_case(3)
    assert best.tolist() == pytest.approx(expected, abs=1e-6)
    assert OnlineLookupSurvival(prior).best_case(2).tolist() == pytest.approx(expected[:2],
                                                                              abs=1e-6)
