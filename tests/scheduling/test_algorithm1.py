"""Algorithm 1 (early-stopping greedy): exact cases, brute-force optimality when Theta is
unimodal, the stop before an SPS cliff, and the batch-token limit."""
import pytest
import torch

from dspark_serve.scheduling import CostTable, make_scheduler
from dspark_serve.scheduling.admission import survival


def test_random_cases_match_brute_force_with_smooth_sps(brute_force, theta_of, smooth_table):
    gen = torch.Generator().manual_seed(0)
    interior = 0
    for case in range(150):
        num_req, gamma = int(torch.randint(1, 4, (1,), generator=gen)), int(
            torch.randint(1, 4, (1,), generator=gen))
        conf = torch.empty(num_req, gamma).uniform_(0.2, 1.0, generator=gen)
        t1 = float(torch.empty(1).uniform_(0.05, 0.8, generator=gen))
        table = smooth_table(num_req * (gamma + 1), 1.0, t1)
        lengths = make_scheduler("algorithm1", gamma=gamma, cost_table=table)(conf)
        best, _ = brute_force(survival(conf), table)
        assert theta_of(survival(conf), lengths, table) == pytest.approx(best, rel=1e-12), case
        interior += 0 < int(lengths.sum()) < num_req * gamma
    assert interior > 30   # the optimum is often neither "verify nothing" nor "verify all"


def test_exact_case():
    # a = [[0.9, 0.45], [0.6, 0.06]]; ranking 0.9, 0.6, 0.45, 0.06.
    conf = torch.tensor([[0.9, 0.5], [0.6, 0.1]])
    # SPS(B) = 12 / B for B <= 4, then a cliff: Theta_k = (2 + S_k) * 12 / (2 + k):
    # k=0: 12.0, k=1: 11.6, stop -> l = [0, 0].
    table = CostTable((2, 3, 4, 5, 6), (6.0, 4.0, 3.0, 1.0, 1.0), 6)
    assert make_scheduler("algorithm1", gamma=2, cost_table=table)(conf).tolist() == [0, 0]
    # Flat SPS up to B=5: every positive slot raises tau until the cliff at B=6.
    table = CostTable((5, 6), (1.0, 0.5), 6)
    assert make_scheduler("algorithm1", gamma=2, cost_table=table)(conf).tolist() == [2, 1]


def test_stops_before_a_cliff_that_global_search_would_cross():
    conf = torch.tensor([[0.9, 0.9, 0.9]])
    table = CostTable((1, 2, 4), (1.0, 0.5, 0.5), 4)
    # Theta_0 = 1.0 > Theta_1 = 0.95 -> stop, although Theta_3 = 1.7195 is the global maximum.
    assert make_scheduler("algorithm1", gamma=3, cost_table=table)(conf).tolist() == [0]


def test_zero_survival_slots_are_never_admitted():
    # Rising SPS would reward a larger batch, but a = 0 adds no expected tokens.
    conf = torch.tensor([[1.0, 0.0, 1.0], [0.5, 0.5, 0.5]])
    table = CostTable((2, 8), (1.0, 2.0), 8)
    assert make_scheduler("algorithm1", gamma=3, cost_table=table)(conf).tolist() == [1, 3]


def test_batch_token_limits():
    conf = torch.full((4, 5), 0.99)
    table = CostTable((1, 64), (1.0, 1.0), 64)      # flat: wants to verify everything
    assert make_scheduler("algorithm1", gamma=5, cost_table=table)(conf).sum() == 20
    lengths = make_scheduler("algorithm1", gamma=5, cost_table=table, max_batch_tokens=11)(conf)
    assert int((1 + lengths).sum()) == 11
    small = CostTable((1, 9), (1.0, 1.0), 9)         # the table's own limit binds too
    assert int((1 + make_scheduler("algorithm1", gamma=5, cost_table=small)(conf)).sum()) == 9
    with pytest.raises(ValueError, match="more than the limit of 3"):
        make_scheduler("algorithm1", gamma=5, cost_table=table, max_batch_tokens=3)(conf)
