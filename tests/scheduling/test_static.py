"""Static (verify everything) and static-threshold baselines."""
import pytest
import torch

from dspark_serve.scheduling import make_scheduler

CONF = torch.tensor([[0.9, 0.4, 0.9],
                     [0.5, 0.5, 0.5],
                     [0.1, 0.9, 0.9],
                     [1.0, 1.0, 0.0]])


def test_static_verifies_the_whole_block():
    assert make_scheduler("static", gamma=3)(CONF).tolist() == [3, 3, 3, 3]


@pytest.mark.parametrize("threshold, expected", [
    (0.5, [1, 3, 0, 2]),        # first c < threshold; c == threshold passes
    (0.95, [0, 0, 0, 2]),
    (1.0, [0, 0, 0, 2]),
    (1.5, [0, 0, 0, 0]),
    (0.0, [3, 3, 3, 3]),        # threshold <= 0: full block, as DeepSpec
    (-1.0, [3, 3, 3, 3]),
])
def test_threshold(threshold, expected):
    assert make_scheduler("threshold", gamma=3, threshold=threshold)(CONF).tolist() == expected


def test_budget_keeps_the_most_likely_slots():
    # a = [[.9,.36,.324], [.5,.25,.125], [.1,.09,.081], [1,1,0]], B <= 4 + 5 -> 5 drafts.
    static = make_scheduler("static", gamma=3, max_batch_tokens=9)(CONF)
    assert static.tolist() == [2, 1, 0, 2]           # 1, .9, 1, .5, .36
    # Threshold 0.5 allows [1, 3, 0, 2]; its 4 best: 1, .9, 1, .5.
    threshold = make_scheduler("threshold", gamma=3, threshold=0.5, max_batch_tokens=8)(CONF)
    assert threshold.tolist() == [1, 1, 0, 2]
    # Zero-survival slots are still verified by "static" when the budget allows.
    assert make_scheduler("static", gamma=3, max_batch_tokens=16)(CONF).tolist() == [3] * 4
    assert make_scheduler("static", gamma=3, max_batch_tokens=15)(CONF).tolist() == [3, 3, 3, 2]


def test_empty_batch():
    assert make_scheduler("threshold", gamma=3)(torch.zeros(0, 3)).shape == (0,)
    assert make_scheduler("static", gamma=3, max_batch_tokens=1)(torch.zeros(0, 3)).shape == (0,)
