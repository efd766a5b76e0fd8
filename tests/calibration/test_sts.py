import pytest
import torch

from dspark_serve.calibration.metrics import auroc, per_position_metrics
from dspark_serve.calibration.sts import (calibrated_confidence, default_temperature_grid,
                                          fit_calibration, fit_sts, prefix_survival_labels)


def test_calibrated_confidence_divides_logit_by_temperature():
    z = torch.tensor([[2.0, -1.0, 0.5], [-4.0, 3.0, 0.0]])
    t = torch.tensor([2.0, 0.5, 4.0])
    c = calibrated_confidence(z, t)
    assert c.dtype == torch.float32
    expected = torch.sigmoid(torch.tensor([[1.0, -2.0, 0.125], [-2.0, 6.0, 0.0]]))
    torch.testing.assert_close(c, expected, rtol=0, atol=0)
    assert calibrated_confidence(z.double(), t).dtype == torch.float64


@pytest.mark.parametrize("z, t", [
    (torch.zeros(4, 3), torch.ones(2)),            # gamma mismatch
    (torch.zeros(4), torch.ones(4)),               # not [N, gamma]
    (torch.zeros(4, 3), torch.tensor([1.0, 0.0, 1.0])),
    (torch.zeros(4, 3), torch.tensor([1.0, -2.0, 1.0])),
    (torch.zeros(4, 3), torch.tensor([1.0, float("inf"), 1.0])),
])
def test_calibrated_confidence_bad_input(z, t):
    with pytest.raises(ValueError):
        calibrated_confidence(z, t)


def test_prefix_survival_labels():
    survived, valid = prefix_survival_labels(torch.tensor([0, 2, 1, 3]), torch.tensor([0, 3, 1, 3]), 3)
    assert survived.tolist() == [[False] * 3, [True, True, False], [True, False, False], [True] * 3]
    assert valid.tolist() == [[False] * 3, [True] * 3, [True, False, False], [True] * 3]
    with pytest.raises(ValueError):
        prefix_survival_labels(torch.tensor([2]), torch.tensor([1]), 3)  # accepted more than verified
    with pytest.raises(ValueError):
        prefix_survival_labels(torch.tensor([0]), torch.tensor([4]), 3)


def _survival(logits, temperatures):
    return torch.cumprod(calibrated_confidence(logits, temperatures), dim=1)


def test_sts_recovers_overconfident_head_and_lowers_ece(overconfident_rounds, head_scale):
    logits, true_c, survived = overconfident_rounds
    t = fit_sts(logits, survived)
    assert t.dtype == torch.float32 and t.shape == (5,)
    # grid ratio is 10**0.05, so the truth 2.5 lies within 2 grid steps of the fit (sampling noise)
    assert ((t > head_scale / 1.26) & (t < head_scale * 1.26)).all(), t
    before = per_position_metrics(_survival(logits, torch.ones(5)), survived).ece
    after = per_position_metrics(_survival(logits, t), survived).ece
    oracle = per_position_metrics(torch.cumprod(true_c, 1), survived).ece
    assert (before > 0.08).all() and (after < 0.02).all(), (before, after)
    assert (after <= oracle + 0.005).all()  # no worse than the true probabilities, within noise


def test_sts_keeps_ranking_of_each_position(overconfident_rounds):
    logits, _, survived = overconfident_rounds
    t = fit_sts(logits, survived)
    c_raw, c_sts = torch.sigmoid(logits), calibrated_confidence(logits, t)
    # conditional AUROC of c_k on rows whose prefix 1..k-1 survived, and a_1
    for k in range(5):
        rows = survived[:, k - 1] if k else torch.ones_like(survived[:, 0])
        a, b = auroc(c_raw[rows, k], survived[rows, k]), auroc(c_sts[rows, k], survived[rows, k])
        assert abs(a - b) < 1e-9 and 0.7 < a < 1.0
    assert abs(auroc(c_raw[:, 0], survived[:, 0]) - auroc(c_sts[:, 0], survived[:, 0])) < 1e-9


def test_product_of_rescaled_positions_need_not_keep_order():
    # why the order-preservation claim is per position: a_2 = c_1 c_2 can reorder rows
    z = torch.tensor([[2.0, 0.0], [0.0, 1.5]], dtype=torch.float64)
    raw, sts = _survival(z, torch.ones(2)), _survival(z, torch.tensor([10.0, 1.0]))
    assert (raw[0, 1] > raw[1, 1]) and (sts[0, 1] < sts[1, 1])


def test_identity_on_calibrated_head(make_rounds, head_scale):
    logits, _, survived = make_rounds(20000, 3, seed=5)
    t = fit_sts(logits / head_scale, survived)
    assert ((t > 1 / 1.26) & (t < 1.26)).all(), t


def _censored(logits, survived):
    """Rounds verified by a threshold scheduler on the raw confidence: l_r is chosen from
    features only (non-anticipating), and positions past l_r are unobserved."""
    lengths = (torch.cumprod(torch.sigmoid(logits), 1) >= 0.5).sum(1)
    num_accepted = torch.minimum(survived.sum(1), lengths)
    return num_accepted, lengths


def test_valid_mask_excludes_unverified_positions(overconfident_rounds, head_scale):
    logits, _, survived = overconfident_rounds
    num_accepted, lengths = _censored(logits, survived)
    labels, valid = prefix_survival_labels(num_accepted, lengths, 5)
    assert valid.sum(0).tolist()[-1] < 5000  # heavy censoring at the last position
    t = fit_sts(logits, labels, valid=valid)
    assert ((t > head_scale / 1.26) & (t < head_scale * 1.26)).all(), t
    # labels outside the mask are ignored entirely
    noise = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    torch.testing.assert_close(fit_sts(logits, torch.where(valid, labels, noise), valid=valid), t, rtol=0, atol=0)


def test_censoring_by_length_is_unbiased_but_keeping_known_zeros_is_not(overconfident_rounds):
    logits, true_c, survived = overconfident_rounds
    num_accepted, lengths = _censored(logits, survived)
    labels, valid = prefix_survival_labels(num_accepted, lengths, 5)
    known = valid | (num_accepted < lengths).unsqueeze(1)  # adds rows rejected before l_r < k
    oracle = torch.cumprod(true_c, 1)
    for k in range(1, 5):
        z = {}
        for name, mask in (("valid", valid[:, k]), ("known", known[:, k])):
            p = oracle[mask, k]
            # observed minus expected survival rate, in standard errors of the Bernoulli sum
            z[name] = float((labels[mask, k].double() - p).sum() / (p * (1 - p)).sum().sqrt())
        assert abs(z["valid"]) < 4 and z["known"] < -4, (k, z)


def test_fit_calibration_record(overconfident_rounds):
    logits, _, survived = overconfident_rounds
    cal = fit_calibration(logits[:4000], survived[:4000], dataset="synthetic, serving T=1.0")
    assert cal.gamma == 5 and cal.num_samples == 4000 and cal.dataset == "synthetic, serving T=1.0"
    assert all(b > a for b, a in zip(cal.ece_before, cal.ece_after))
    torch.testing.assert_close(cal.temperatures_for(5), fit_sts(logits[:4000], survived[:4000]))


def test_grid_is_sglangs():
    grid = default_temperature_grid()
    assert grid.numel() == 41 and grid[0].item() == pytest.approx(0.1) and grid[-1].item() == pytest.approx(10.0)
    assert grid[20].item() == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs, exc", [
    (dict(survived=torch.ones(10, 2, dtype=torch.bool)), ValueError),           # shape mismatch
    (dict(survived=torch.ones(10, 3)), TypeError),                                # not bool
    (dict(valid=torch.ones(10, 2, dtype=torch.bool)), ValueError),
    (dict(grid=torch.tensor([1.0, 0.0])), ValueError),
    (dict(grid=torch.tensor([])), ValueError),
    (dict(valid=torch.tensor([[True, True, False]] * 10)), ValueError),          # no rows at position 3
    (dict(survived=torch.tensor([[False, True, True]] * 10)), ValueError),       # not prefix-closed
])
def test_fit_sts_bad_input(kwargs, exc):
    args = dict(survived=torch.ones(10, 3, dtype=torch.bool))
    args.update(kwargs)
    survived = args.pop("survived")
    with pytest.raises(exc):
        fit_sts(torch.zeros(10, 3), survived, **args)
