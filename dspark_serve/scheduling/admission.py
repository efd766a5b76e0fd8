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

from typing import NamedTuple

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


def valid_confidence_rows(confidence: torch.Tensor) -> torch.Tensor:
    """[R, gamma] float -> [R] bool: True where every value of the row is finite and in
    [0, 1], the rows ``check_confidence`` would accept (NaN and +-inf fail)."""
    return ((confidence >= 0) & (confidence <= 1)).all(dim=1)


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
    return confidence.float().cumprod(dim=1)


class Ranking(NamedTuple):
    """All R*gamma draft slots in admission order (``rank_slots``).

    values:   [n] float64 survival, descending; ineligible slots -1, last.
    rows:     [n] int64 request of each ranked slot.
    cum:      [n + 1] float64 S_k = summed survival of the first k slots (ineligible as 0):
              the expected accepted draft tokens when they are verified.
    positive: number of eligible slots with survival > 0, ranked first.
    eligible: number of eligible slots (positive ones, then zero-survival ones).
    """

    values: torch.Tensor
    rows: torch.Tensor
    cum: torch.Tensor
    positive: int
    eligible: int


def rank_slots(surv: torch.Tensor, eligible: torch.Tensor | None = None) -> Ranking:
    """Global prefix-respecting ranking of all R*gamma draft slots.

    Args:
        surv: [R, gamma] float32 survival a_{r,j} (``survival``).
        eligible: optional [R, gamma] bool, prefix-closed per row; ineligible slots rank last.
    Returns:
        ``Ranking``, tensors on the device of ``surv``.
    """
    num_req = surv.shape[0]
    if surv.device.type == "cpu":
        mask = None if eligible is None else eligible.numpy().T.ravel()
        return _rank_on_host(surv.numpy().T.ravel(), mask, num_req)
    mask = None if eligible is None else eligible.t().reshape(-1)
    return _rank_on_device(surv.t().reshape(-1), mask, num_req)


# Both rankers flatten position-major and sort one unique int64 key per slot: minus the
# float32 bits (ordered like the values, all >= 0 or the ineligible -1) in the high half, the
# flat index in the low 32 bits. Ascending keys = descending survival, ties by position then
# request, whatever the sort algorithm, and the sorted keys carry the order in their low bits.
# "+ 0.0" turns a -0.0 survival (from a -0.0 confidence) into +0.0, whose bits rank as zero.
_LOW_32 = 0xFFFFFFFF


def _rank_on_host(flat: np.ndarray, eligible: np.ndarray | None, num_req: int) -> Ranking:
    # NumPy: far less per-call overhead than torch on these small arrays, and its
    # (vectorised) sort of plain int64 values is several times faster than torch.sort.
    flat = flat + np.float32(0.0)
    if eligible is not None:
        flat[~eligible] = _INELIGIBLE
    keys = np.arange(flat.size) - (flat.view(np.int32).astype(np.int64) << 32)
    order = np.sort(keys) & _LOW_32
    values = flat[order].astype(np.float64)
    cum = np.zeros(values.size + 1)
    np.cumsum(np.maximum(values, 0.0), out=cum[1:])
    return Ranking(torch.from_numpy(values), torch.from_numpy(order % num_req),
                   torch.from_numpy(cum), int(np.count_nonzero(values > 0)),
                   int(np.count_nonzero(values >= 0)))


def _rank_on_device(flat: torch.Tensor, eligible: torch.Tensor | None, num_req: int) -> Ranking:
    flat = flat + 0.0
    if eligible is not None:
        flat = flat.masked_fill(~eligible, _INELIGIBLE)
    index = torch.arange(flat.numel(), device=flat.device)
    order = torch.sort(index - (flat.view(torch.int32).long() << 32)).values & _LOW_32
    values = flat[order].double()
    cum = torch.cat([values.new_zeros(1), values.clamp(min=0).cumsum(0)])
    counts = torch.stack([(values > 0).sum(), (values >= 0).sum()]).tolist()
    return Ranking(values, order % num_req, cum, *counts)


def admit_first(rows: torch.Tensor, k: int, num_requests: int) -> torch.Tensor:
    """l_r = number of request r's slots among the first ``k`` ranked slots (``rank_slots``).
    Returns [R] int64, each a valid prefix length in 0..gamma."""
    return torch.bincount(rows[:k], minlength=num_requests)


def max_admissions(num_requests: int, admissible: int, limit: int | None) -> int:
    """Most slots that may be admitted: ``admissible`` capped by the batch-token limit."""
    return admissible if limit is None else min(admissible, limit - num_requests)


def throughput_curve(cum_survival: torch.Tensor, num_requests: int, max_k: int,
                     cost_table: CostTable, overhead_s: float | torch.Tensor = 0.0
                     ) -> torch.Tensor:
    """Theta_k = (R + S_k) / (1 / SPS(R + k) + overhead_s) in expected tokens/s for admitting
    the first k ranked slots, k = 0..max_k: [max_k + 1] float64 (``cum_survival`` as
    ``Ranking.cum``; ``cost_table``: a CostTable or ``step_cost.MeasuredStepCost``;
    ``overhead_s``: seconds the step spends outside the target forward, e.g. drafting, one
    for every k or [max_k + 1] float64 per k; 0 gives the paper's (R + S_k) * SPS(R + k))."""
    sps = cost_table.sps_range(num_requests, num_requests + max_k + 1, cum_survival.device)
    tokens = cum_survival[:max_k + 1] + num_requests
    if not isinstance(overhead_s, torch.Tensor) and overhead_s <= 0:
        return tokens * sps
    overhead_s = torch.as_tensor(overhead_s, dtype=torch.float64, device=sps.device)
    # SPS 0 (B over the table's limit) stays Theta 0.
    return torch.where(sps > 0, tokens * sps / (1 + overhead_s * sps), 0.0)
