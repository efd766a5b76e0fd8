"""Reference computations for the scheduler tests: the throughput objective of paper Section
3.2.2 evaluated directly, and its exhaustive maximum over every prefix-respecting allocation."""
import itertools

import pytest
import torch

from dspark_serve.scheduling import CostTable


def theta_of(surv: torch.Tensor, lengths, table: CostTable) -> float:
    """Theta = tau * SPS(B), tau = sum(1 + sum_{j<=l_r} a_{r,j}), B = sum(1 + l_r)."""
    lengths = [int(v) for v in lengths]
    tau = sum(1.0 + float(surv[r, :l].double().sum()) for r, l in enumerate(lengths))
    batch = sum(1 + l for l in lengths)
    return tau * float(table.sps(torch.tensor([batch]))[0])


def brute_force(surv: torch.Tensor, table: CostTable, limit: int | None = None
                ) -> tuple[float, int]:
    """(max Theta, smallest total draft count among maximisers) over all l_r in 0..(number of
    positive survivals in row r), with B <= limit."""
    caps = [int((row > 0).sum()) for row in surv]
    scored = []
    for lengths in itertools.product(*(range(c + 1) for c in caps)):
        if limit is not None and sum(1 + l for l in lengths) > limit:
            continue
        scored.append((theta_of(surv, lengths, table), sum(lengths)))
    best = max(t for t, _ in scored)
    return best, min(k for t, k in scored if t >= best * (1 - 1e-12))


def smooth_table(max_tokens: int, t0: float, t1: float) -> CostTable:
    """A probe at every B with affine step time t0 + t1 * B: Theta is unimodal along the
    greedy path, the case where Algorithm 1's early stop is globally optimal."""
    batch = list(range(1, max_tokens + 1))
    return CostTable.from_step_times(batch, [t0 + t1 * b for b in batch])


def jagged_table(max_tokens: int, gen: torch.Generator) -> CostTable:
    """Step-wise SPS: flat stretches separated by cliffs of random position and depth, so
    Theta has several local maxima (paper Section 5.2)."""
    edges = sorted(set(torch.randint(2, max_tokens + 1, (4,), generator=gen).tolist()))
    sps, level = [], 1.0
    for b in range(1, max_tokens + 1):
        if b in edges:
            level *= float(torch.empty(1).uniform_(0.3, 0.8, generator=gen))
        sps.append(level)
    return CostTable(tuple(range(1, max_tokens + 1)), tuple(sps), max_tokens)


@pytest.fixture(name="theta_of")
def theta_of_fixture():
    return theta_of


@pytest.fixture(name="brute_force")
def brute_force_fixture():
    return brute_force


@pytest.fixture(name="smooth_table")
def smooth_table_fixture():
    return smooth_table


@pytest.fixture(name="jagged_table")
def jagged_table_fixture():
    return jagged_table
