import itertools
import math
import struct

import pytest
import torch

from dspark_serve.calibration.metrics import (auroc, brier, calibration_bins, ece, ece_columns,
                                              per_position_metrics, reliability_diagram)

P = torch.tensor([0.05, 0.15, 0.35, 0.42, 0.61, 0.95])
Y = torch.tensor([False, True, False, True, True, True])


def test_ece_hand_computed():
    # 5 bins: [0.05, 0.15] -> bin 0, [0.35] -> 1, [0.42] -> 2, [0.61] -> 3, [0.95] -> 4
    # |sum(p - y)| per bin: |0.20 - 1| + 0.35 + |0.42 - 1| + |0.61 - 1| + |0.95 - 1|
    expected = (0.80 + 0.35 + 0.58 + 0.39 + 0.05) / 6
    assert ece(P, Y, num_bins=5) == pytest.approx(expected, abs=1e-7)
    # one bin: |mean p - mean y|
    assert ece(P, Y, num_bins=1) == pytest.approx(abs(P.double().mean().item() - 4 / 6), abs=1e-7)


def test_ece_probability_one_joins_last_bin():
    assert ece(torch.tensor([1.0, 0.9]), torch.tensor([True, False]), num_bins=10) == pytest.approx(0.45)


def test_ece_columns_matches_ece_per_column():
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(500, 7, generator=g, dtype=torch.float64)
    labels = torch.rand(500, generator=g) < 0.6
    cols = ece_columns(probs, labels, num_bins=12)
    assert cols.dtype == torch.float64 and cols.shape == (7,)
    for j in range(7):
        assert cols[j].item() == pytest.approx(ece(probs[:, j], labels, num_bins=12), abs=1e-12)


def test_brier_hand_computed():
    expected = (0.05**2 + 0.85**2 + 0.35**2 + 0.58**2 + 0.39**2 + 0.05**2) / 6
    assert brier(P, Y) == pytest.approx(expected, abs=1e-7)


def test_auroc_hand_computed_with_ties():
    scores = torch.tensor([0.1, 0.4, 0.4, 0.8])
    labels = torch.tensor([False, False, True, True])
    # pairs (pos, neg): (0.4,0.1)=1, (0.4,0.4)=0.5, (0.8,0.1)=1, (0.8,0.4)=1 -> 3.5 / 4
    assert auroc(scores, labels) == 0.875
    assert auroc(P, Y) == 1.0 - 1 / 8  # only the pair (0.15 pos, 0.35 neg) is misordered
    assert math.isnan(auroc(P, torch.ones(6, dtype=torch.bool)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auroc_equals_brute_force_pair_count(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 12, (300,), generator=g).double() / 11  # many ties
    labels = torch.rand(300, generator=g) < 0.4
    pos, neg = scores[labels].tolist(), scores[~labels].tolist()
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg))
    assert auroc(scores, labels) == pytest.approx(wins / (len(pos) * len(neg)), abs=1e-12)


def test_per_position_metrics_respects_valid_mask():
    survival = torch.tensor([[0.9, 0.5], [0.8, 0.3], [0.2, 0.1], [0.6, 0.9]])
    survived = torch.tensor([[True, True], [True, False], [False, False], [True, True]])
    valid = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    m = per_position_metrics(survival, survived, valid, num_bins=10)
    assert m.count.tolist() == [4, 3]
    rows = valid[:, 1]
    assert m.ece[1].item() == pytest.approx(ece(survival[rows, 1], survived[rows, 1], num_bins=10))
    assert m.brier[1].item() == pytest.approx((0.25 + 0.01 + 0.01) / 3)
    assert m.auroc[0].item() == 1.0 and m.auroc[1].item() == 1.0
    empty = per_position_metrics(survival, survived, torch.zeros_like(valid))
    assert empty.count.tolist() == [0, 0] and torch.isnan(empty.ece).all()


def test_calibration_bins():
    count, mean_p, rate = calibration_bins(P, Y, num_bins=2)
    assert count.tolist() == [4, 2]
    assert mean_p[0].item() == pytest.approx(0.2425) and rate[0].item() == 0.5
    assert mean_p[1].item() == pytest.approx(0.78) and rate[1].item() == 1.0


@pytest.mark.parametrize("call", [
    lambda: ece(P, Y[:5]),
    lambda: ece(P * 2, Y),
    lambda: ece(torch.tensor([float("nan")]), torch.tensor([True])),
    lambda: ece(P[:0], Y[:0]),
    lambda: ece(P, Y, num_bins=0),
    lambda: brier(P, Y[:3]),
    lambda: auroc(P, Y[1:]),
    lambda: per_position_metrics(P.view(3, 2), Y.view(3, 2), torch.ones(2, 3, dtype=torch.bool)),
])
def test_bad_input_raises_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_non_bool_labels_raise_type_error():
    with pytest.raises(TypeError):
        ece(P, Y.float())


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("pooled, figsize, size", [(False, (8.0, 6.0), (800, 600)),
                                                   (True, (4.0, 3.0), (400, 300))])
def test_reliability_diagram_writes_png(tmp_path, overconfident_rounds, pooled, figsize, size):
    logits, true_c, survived = overconfident_rounds
    raw = torch.cumprod(torch.sigmoid(logits[:2000]), 1)
    ideal = torch.cumprod(true_c[:2000], 1)
    path = reliability_diagram(tmp_path / "sub" / "rel.png", raw, survived[:2000], survival_after=ideal,
                               pooled=pooled, figsize=figsize, dpi=100, title="synthetic")
    assert path.stat().st_size > 10_000
    assert _png_size(path) == size


def test_reliability_diagram_default_size_and_shape_check(tmp_path):
    survival = torch.rand(50, 3, generator=torch.Generator().manual_seed(0))
    survived = survival > 0.5
    path = reliability_diagram(tmp_path / "raw.png", survival, survived, dpi=50)
    assert _png_size(path) == (600, 170)  # 3 panels of 4 x 3.4 inches at 50 dpi
    with pytest.raises(ValueError):
        reliability_diagram(tmp_path / "bad.png", survival, survived, survival_after=survival[:, :2])
