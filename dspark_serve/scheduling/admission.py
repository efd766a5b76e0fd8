"""Building blocks shared by the schedulers: input checks, survival probabilities, the global
prefix-respecting ranking of draft slots, top-K admission and the throughput curve
Theta_k = tau_k * SPS(B_k) along the greedy admission path (paper Section 3.2.2).

Ranking: slot (r, j) (request r, draft position j, 1-based) has survival a_{r,j} = prod_{i<=j}
c_{r,i}, non-increasing in j. Slots are sorted by a descending with ties broken by position, then
request, so a request's slot j always precedes its slot j+1: any first-K cut of the ranking is
a set of per-request prefixes.

Non-anticipation (why top-K admission is lossless): whether slot (r, k) falls among the first K
depends only on K and on slots ranked before it, i.e. other requests' slots (independent of
x_{r,k}) and (r, j<k), whose survival uses c_{r,1..j}, known before x_{r,k} is sampled.
"""
from __future__ import annotations

import numpy as np
import torch

from dspark_serve.scheduling.cost_table import CostTable

# Survival given to slots a scheduler may not admit, so they sort after every eligible slot.
_INELIGIBLE = -1.0


def check_confidence(confidence: torch.Tensor, gamma: int) -> None:
    """Raise TypeError unless ``confidence`` is a floating tensor, ValueError unless it is
    [R, gamma] with every value in [0, 1] (NaN fails)."""
    if not isinstance(confidence, torch.Tensor) or not confidence.is_floating_point():
        raise TypeError("confidence must be a floating-point tensor [R, gamma]")
    if confidence.dim() != 2 or confidence.shape[1] != gamma:
        raise ValueError(f"confidence must have shape [R, {gamma}], got {list(confidence.shape)}")
    if confidence.numel():
        lowest, highest = torch.aminmax(confidence)      # NaN propagates and fails both tests
        if not (lowest.item() >= 0 and highest.item() <= 1):
            raise ValueError("confidence values must lie in [0, 1] (calibrated conditional "
                             "survival c_{r,k}, not logits)")


def check_gamma(gamma: int) -> None:
    """Raise TypeError/ValueError unless the block size ``gamma`` is an int >= 1."""
    if isinstance(gamma, bool) or not isinstance(gamma, int):
        raise TypeError(f"gamma must be an int, got {gamma!r}")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")


def check_budget(max_batch_tokens: int | None) -> None:
    """Raise TypeError/ValueError unless ``max_batch_tokens`` is None or an int >= 1."""
    if max_batch_tokens is None:
        return
    if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int):
        raise TypeError(f"max_batch_tokens must be an int or None, got {max_batch_tokens!r}")
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")


def batch_limit(num_requests: int, max_batch_tokens: int | None,
                cost_table: CostTable | None = None) -> int | None:
    """The binding batch-token limit (explicit budget or the table's ``max_batch_tokens``),
    None when unlimited. Raises ValueError when even l_r = 0 for all R requests (B = R)
    does not fit."""
    limits = [] if max_batch_tokens is None else [max_batch_tokens]
    if cost_table is not None:
        limits.append(cost_table.max_batch_tokens)
    limit = min(limits, default=None)
    if limit is not None and num_requests > limit:
        raise ValueError(f"{num_requests} requests need at least {num_requests} batch tokens, "
                         f"more than the limit of {limit}")
    return limit


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """a_{r,j} = prod_{i<=j} c_{r,i}: [R, gamma] float -> [R, gamma] float32 (the confidence
    head's precision; ``rank_slots`` ranks these values exactly)."""
    # + 0.0 turns a -0.0 (allowed in the input) into +0.0, whose bits rank as zero.
    return confidence.float().cumprod(dim=1) + 0.0


def rank_slots(surv: torch.Tensor, eligible: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Global prefix-respecting ranking of all R*gamma draft slots.

    Args:
        surv: [R, gamma] float32 survival a_{r,j} (``survival``).
        eligible: optional [R, gamma] bool, prefix-closed per row; ineligible slots rank last
            with value -1.
    Returns:
        (values [R*gamma] float64 descending, rows [R*gamma] int64 request of each ranked slot).
    """
    num_req = surv.shape[0]
    keyed = surv if eligible is None else surv.masked_fill(~eligible, _INELIGIBLE)
    flat = keyed.t().reshape(-1)                                  # position-major
    if flat.device.type == "cpu":
        return _rank_on_host(flat.numpy(), num_req)
    return _rank_on_device(flat, num_req)


# Both rankers sort one unique int64 key per slot: the float32 bits (ordered like the values,
# all >= 0 or the ineligible -1) in the high half minus the position-major index, so ascending
# keys = descending survival, ties by position then request, whatever the sort algorithm.

def _rank_on_host(flat: np.ndarray, num_req: int) -> tuple[torch.Tensor, torch.Tensor]:
    # NumPy: far less per-call overhead than torch for these small arrays, and its introsort
    # beats torch.sort on the host.
    keys = np.arange(flat.size) - (flat.view(np.int32).astype(np.int64) << 32)
    order = np.argsort(keys)
    return torch.from_numpy(flat[order].astype(np.float64)), torch.from_numpy(order % num_req)


def _rank_on_device(flat: torch.Tensor, num_req: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.arange(flat.numel(), device=flat.device)
    order = torch.argsort(index - (flat.view(torch.int32).long() << 32))
    return flat[order].double(), order % num_req


def num_admissible(values: torch.Tensor, *, admit_zero: bool = False) -> int:
    """Leading ranked slots that may be admitted: eligible ones, and unless ``admit_zero``
    only those with survival > 0 (a zero-survival slot cannot add expected accepted tokens)."""
    admissible = (values >= 0) if admit_zero else (values > 0)
    return int(admissible.sum())


def admit_first(rows: torch.Tensor, k: int, num_requests: int) -> torch.Tensor:
    """l_r = number of request r's slots among the first ``k`` ranked slots (``rank_slots``).
    Returns [R] int64, each a valid prefix length in 0..gamma."""
    return torch.bincount(rows[:k], minlength=num_requests)


def cumulative(values: torch.Tensor) -> torch.Tensor:
    """[n] ranked survival (ineligible entries < 0) -> [n + 1] float64 prefix sums from 0:
    S_k, the expected accepted draft tokens when the first k ranked slots are verified."""
    return torch.cat([values.new_zeros(1), values.clamp(min=0).cumsum(0)])


def max_admissions(num_requests: int, admissible: int, limit: int | None) -> int:
    """Most slots that may be admitted: ``admissible`` capped by the batch-token limit."""
    return admissible if limit is None else min(admissible, limit - num_requests)


def throughput_curve(cum_survival: torch.Tensor, num_requests: int, max_k: int,
                     cost_table: CostTable) -> torch.Tensor:
    """Theta_k = (R + S_k) * SPS(R + k) in expected tokens/s for admitting the first k ranked
    slots, k = 0..max_k: [max_k + 1] float64 (``cum_survival`` as from ``cumulative``)."""
    sps = cost_table.sps_range(num_requests, num_requests + max_k + 1, cum_survival.device)
    return (cum_survival[:max_k + 1] + num_requests) * sps
