"""Load-blind baselines (paper Section 3.2.2, "Prior methods typically apply a static threshold").

- ``StaticScheduler``: verify the whole block, l_r = gamma.
- ``ThresholdScheduler``: l_r = index of the first position with c_{r,k} < threshold (gamma
  if none), DeepSpec's ``_confident_prefix_length`` applied to calibrated confidences (it takes
  sigmoid(logit) itself; here c is already calibrated). threshold <= 0 verifies the full block.
  Lossless: l_r >= k depends only on c_{r,1..k}, known before x_{r,k} is sampled.

With ``max_batch_tokens`` both keep, of the slots they would verify, the top
K = max_batch_tokens - R by survival (prefix-respecting, zero-survival slots included).
"""
from __future__ import annotations

import math

import torch

from dspark_serve.scheduling import admission


class StaticScheduler:
    """l_r = gamma for every request, optionally cut to ``max_batch_tokens``.
    Raises TypeError/ValueError for a bad gamma or budget."""

    def __init__(self, gamma: int, max_batch_tokens: int | None = None):
        admission.check_gamma(gamma)
        admission.check_budget(max_batch_tokens)
        self.gamma = gamma
        self.max_batch_tokens = max_batch_tokens

    def __call__(self, confidence: torch.Tensor) -> torch.Tensor:
        """confidence [R, gamma] float in [0, 1] -> lengths [R] int64.
        Raises TypeError/ValueError for bad confidence or R above ``max_batch_tokens``."""
        admission.check_confidence(confidence, self.gamma)
        lengths = torch.full((confidence.shape[0],), self.gamma, dtype=torch.int64,
                             device=confidence.device)
        return _fit_budget(confidence, lengths, self.max_batch_tokens)


class ThresholdScheduler:
    """l_r = first k with c_{r,k} < threshold, optionally cut to ``max_batch_tokens``.
    Raises TypeError/ValueError for a bad gamma, budget or a non-finite threshold."""

    def __init__(self, gamma: int, threshold: float = 0.5, max_batch_tokens: int | None = None):
        admission.check_gamma(gamma)
        admission.check_budget(max_batch_tokens)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise TypeError(f"threshold must be a number, got {threshold!r}")
        if not math.isfinite(threshold):
            raise ValueError(f"threshold must be finite, got {threshold}")
        self.gamma = gamma
        self.threshold = float(threshold)
        self.max_batch_tokens = max_batch_tokens

    def __call__(self, confidence: torch.Tensor) -> torch.Tensor:
        """confidence [R, gamma] float in [0, 1] -> lengths [R] int64.
        Raises TypeError/ValueError for bad confidence or R above ``max_batch_tokens``."""
        admission.check_confidence(confidence, self.gamma)
        # c >= threshold always holds for threshold <= 0: the full block, as in DeepSpec.
        lengths = (confidence >= self.threshold).long().cumprod(dim=1).sum(dim=1)
        return _fit_budget(confidence, lengths, self.max_batch_tokens)


def _fit_budget(confidence: torch.Tensor, lengths: torch.Tensor,
                max_batch_tokens: int | None) -> torch.Tensor:
    num_req = confidence.shape[0]
    limit = admission.batch_limit(num_req, max_batch_tokens)
    if limit is None or num_req == 0:
        return lengths
    positions = torch.arange(confidence.shape[1], device=confidence.device)
    eligible = positions[None, :] < lengths[:, None]
    ranking = admission.rank_slots(admission.survival(confidence), eligible)
    return admission.admit_first(ranking.rows, min(limit - num_req, ranking.eligible), num_req)
