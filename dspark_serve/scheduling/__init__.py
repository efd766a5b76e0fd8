"""Verification-length schedulers (paper Section 3.2.2 and 5.2) and the SPS cost table.

Every scheduler is a callable ``sched(confidence) -> lengths``: confidence [R, gamma] float
calibrated conditional survival c_{r,k} in [0, 1] (after STS), lengths [R] int64 l_r in
0..gamma on the same device. Survival a_{r,j} = prod_{i<=j} c_{r,i}; the batch sent to the
target holds B = sum(1 + l_r) tokens. Stateful schedulers (``async``) keep their history inside.
"""
from __future__ import annotations

from typing import Callable

import torch

from dspark_serve.scheduling.algorithm1 import Algorithm1Scheduler
from dspark_serve.scheduling.async_scheduler import AsyncScheduler
from dspark_serve.scheduling.cost_table import CostTable
from dspark_serve.scheduling.static import StaticScheduler, ThresholdScheduler

Scheduler = Callable[[torch.Tensor], torch.Tensor]
SCHEDULER_NAMES = ("algorithm1", "async", "static", "threshold")
# Schedulers that optimise Theta = tau * SPS(B) and so need a profiled cost table.
NEEDS_COST_TABLE = ("algorithm1", "async")

__all__ = ["Algorithm1Scheduler", "AsyncScheduler", "CostTable", "NEEDS_COST_TABLE",
           "SCHEDULER_NAMES", "Scheduler", "StaticScheduler", "ThresholdScheduler",
           "make_scheduler"]


def make_scheduler(name: str, *, gamma: int, cost_table: CostTable | None = None,
                   threshold: float = 0.5, max_batch_tokens: int | None = None) -> Scheduler:
    """Build a scheduler by name.

    Args:
        name: ``"algorithm1"`` (Algorithm 1, early stop), ``"async"`` (Section 5.2, capacity from
            two steps back), ``"static"`` (l_r = gamma) or ``"threshold"`` (first c < threshold).
        gamma: block size.
        cost_table: required by ``algorithm1`` and ``async``, ignored by the others.
        threshold: used by ``threshold`` only.
        max_batch_tokens: optional cap on B = sum(1 + l_r) for every scheduler.
    Raises:
        ValueError: unknown name, or a missing cost table; plus the schedulers' own checks.
    """
    if name not in SCHEDULER_NAMES:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULER_NAMES)}")
    if name in NEEDS_COST_TABLE and cost_table is None:
        raise ValueError(f"scheduler {name!r} needs a cost table (SPS per batch size)")
    if name == "algorithm1":
        return Algorithm1Scheduler(gamma, cost_table, max_batch_tokens)
    if name == "async":
        return AsyncScheduler(gamma, cost_table, max_batch_tokens)
    if name == "static":
        return StaticScheduler(gamma, max_batch_tokens)
    return ThresholdScheduler(gamma, threshold, max_batch_tokens)
