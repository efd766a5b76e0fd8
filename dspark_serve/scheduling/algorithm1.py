"""Hardware-aware prefix scheduler with early stopping (paper Algorithm 1, Section 3.2.2).

Greedy admission along the global survival ranking: starting from l_r = 0 for every request
(B = R, tau = R, Theta_best = R * SPS(R)), admit ranked slots one at a time, updating
B = sum(1 + l_r), tau = sum(1 + sum_{j<=l_r} a_{r,j}) and Theta = tau * SPS(B), and stop at the
first admission with Theta <= Theta_best. Only slots with a > 0 are candidates (a zero-survival
slot cannot add expected accepted tokens).

The break is what makes it lossless (paper Appendix A): the decision to admit slot (r, k) is
taken when the walk reaches it and uses only higher-ranked slots, never a_{r,k+1}, which
depends on the realised token x_{r,k}. The price: the walk stops at the first local maximum of
Theta, which is the global one only if Theta is unimodal (smooth SPS). Across SPS cliffs use the
asynchronous scheduler (Section 5.2).

Vectorised: because the walk never continues past a non-improvement, Theta_best before slot k
is Theta_{k-1}, so the admitted count is the length of the leading run of strict increases of
Theta_0, Theta_1, ... computed with one cumulative sum over the ranking (at most
R * gamma slots, fewer under a batch-token limit).
"""
from __future__ import annotations

import torch

from dspark_serve.scheduling import admission
from dspark_serve.scheduling.cost_table import CostTable


class Algorithm1Scheduler:
    """Paper Algorithm 1 as a callable ``confidence [R, gamma] -> lengths [R] int64``.

    Args:
        gamma: block size (draft tokens per request).
        cost_table: profiled SPS(B).
        max_batch_tokens: optional extra cap on B = sum(1 + l_r).
    Raises:
        TypeError/ValueError: bad gamma, cost table or budget.
    """

    def __init__(self, gamma: int, cost_table: CostTable, max_batch_tokens: int | None = None):
        admission.check_gamma(gamma)
        admission.check_budget(max_batch_tokens)
        if not isinstance(cost_table, CostTable):
            raise TypeError(f"cost_table must be a CostTable, got {type(cost_table).__name__}")
        self.gamma = gamma
        self.cost_table = cost_table
        self.max_batch_tokens = max_batch_tokens

    def __call__(self, confidence: torch.Tensor) -> torch.Tensor:
        """Verification lengths l_r in 0..gamma.

        Args:
            confidence: [R, gamma] float calibrated conditional survival c_{r,k} in [0, 1].
        Returns:
            [R] int64 on the confidence's device; sum(1 + l_r) within the batch-token limit.
        Raises:
            TypeError/ValueError: bad confidence (``admission.check_confidence``), or R alone
            exceeds the batch-token limit.
        """
        admission.check_confidence(confidence, self.gamma)
        num_req = confidence.shape[0]
        if num_req == 0:
            return torch.zeros(0, dtype=torch.int64, device=confidence.device)
        limit = admission.batch_limit(num_req, self.max_batch_tokens, self.cost_table)
        ranking = admission.rank_slots(admission.survival(confidence))
        max_k = admission.max_admissions(num_req, ranking.positive, limit)
        theta = admission.throughput_curve(ranking.cum, num_req, max_k, self.cost_table)
        improving = theta[1:] > theta[:-1]
        num_admitted = int(improving.cumprod(0).sum())
        return admission.admit_first(ranking.rows, num_admitted, num_req)
