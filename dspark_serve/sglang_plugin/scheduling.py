"""The asynchronous scheduler (paper Section 5.2) in the shape SGLang's DSPARK planner calls.

SGLang's ``DSparkVerifyPlanner`` asks two questions per decode step:

- ``compute_budget(...)`` on the host, before step t's drafts exist: the verify budget K (draft
  tokens above one per request). ``LaggedBudgetPlanner`` answers from survival two steps old.
  Under the overlap scheduler the FutureMap confidence relay already delivers step t-2's
  confidence (``CONFIDENCE_RELAY_RING_LAG`` = the overlap's one-step lag plus one), so nothing
  is carried; without overlap the relay lag is 0 and the planner carries two steps itself.
  Requests without a step-t-2 row of their own count as surviving everywhere, the
  AsyncScheduler's convention for missing history: new requests (fewer earlier decode steps
  than the relay lag: their relay row was never written), reused pool slots (generation
  mismatch) and rows that are not confidences (non-finite or outside [0, 1]). SGLang's relay
  buffer starts uninitialised and, off CUDA, reports every row with the current generation, so
  a request joining a running batch gets an unwritten row flagged as history.
  K = argmax_k Theta_k over every prefix count k (no early stop), with our conservative SPS
  lookup (``CostTable``: probe at or above B), unlike SGLang's probe at or below B.
- the per-request verify lengths for step t: ``verify_lens_from_confidence`` admits the top-K
  slots of step t's own survival (prefix-respecting, zero-survival slots never), with optional
  per-request caps, and returns SGLang's verify lengths 1 + l_r.

Both reuse ``dspark_serve.scheduling.admission``; K depends on steps <= t-2 and R only, so
verification stays lossless (``async_scheduler`` module docstring).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_serve.scheduling import admission
from dspark_serve.scheduling.async_scheduler import LAG_STEPS
from dspark_serve.scheduling.cost_table import CostTable


@dataclass
class BudgetDecision:
    """One capacity decision; attribute names match SGLang's ``VerifyBudgetDecision``, which its
    step observers read. ``budget`` = K draft tokens, ``predicted_step_seconds`` = 1/SPS(R+K),
    ``predicted_theta`` = Theta_K in expected tokens/s."""

    budget: int
    predicted_step_seconds: float | None = None
    predicted_theta: float | None = None


def capacity_from_lagged(lagged_confidence: torch.Tensor, has_history: torch.Tensor,
                         cost_table: CostTable,
                         max_batch_tokens: int | None = None) -> BudgetDecision:
    """K from the calibrated conditional survival of two steps ago (Section 5.2).

    Args:
        lagged_confidence: [R, gamma] float, c_{r,k} of each current request at step t-2.
        has_history: [R] bool; False rows (no step t-2 row) survive everywhere, and so do
            rows with a value that is non-finite or outside [0, 1] (not a confidence).
        cost_table: profiled SPS(B).
        max_batch_tokens: optional cap on B = R + K.
    Returns:
        ``BudgetDecision`` with 0 <= K <= R * gamma.
    Raises:
        TypeError: ``lagged_confidence`` is not a floating-point tensor.
        ValueError: bad shapes, or R alone exceeds the batch-token limit.
    """
    if not lagged_confidence.is_floating_point():
        raise TypeError("lagged_confidence must be a floating-point tensor [R, gamma]")
    if lagged_confidence.ndim != 2:
        raise ValueError(f"lagged_confidence must be [R, gamma], got {tuple(lagged_confidence.shape)}")
    num_req, gamma = lagged_confidence.shape
    if has_history.shape != (num_req,) or has_history.dtype != torch.bool:
        raise ValueError(f"has_history must be bool [{num_req}], got {has_history.dtype} "
                         f"{tuple(has_history.shape)}")
    if num_req == 0:
        return BudgetDecision(0)
    conf = lagged_confidence.detach().cpu().float()
    real = has_history.cpu() & admission.valid_confidence_rows(conf)
    surv = admission.survival(conf.masked_fill(~real[:, None], 1.0))
    limit = admission.batch_limit(num_req, max_batch_tokens, cost_table)
    ranking = admission.rank_slots(surv)
    max_k = admission.max_admissions(num_req, ranking.positive, limit)
    theta = admission.throughput_curve(ranking.cum, num_req, max_k, cost_table)
    k = int(theta.argmax())             # first maximum: the smallest K among equal throughputs
    sps = float(cost_table.sps(torch.tensor([num_req + k]))[0])
    return BudgetDecision(k, 1.0 / sps if sps > 0 else None, float(theta[k]))


def verify_lens_from_confidence(confidence: torch.Tensor, budget: int,
                                caps: torch.Tensor | None = None) -> torch.Tensor:
    """Top-K admission of step t's slots, as SGLang verify lengths.

    Args:
        confidence: [R, gamma] float c_{r,k} of this step (any device).
        budget: K >= 0, most draft tokens admitted in total.
        caps: optional [R] int64 most drafts request r may verify (0..gamma); slots past the
            cap are ineligible (a cap depends on the request's state only, never its drafts).
    Returns:
        [R] int32 verify lengths 1 + l_r (l_r in 0..min(gamma, caps[r])), sum(l_r) <= K,
        on the confidence's device.
    Raises:
        ValueError: bad confidence, budget or caps.
    """
    if confidence.ndim != 2:
        raise ValueError(f"confidence must be [R, gamma], got {tuple(confidence.shape)}")
    num_req, gamma = confidence.shape
    admission.check_confidence(confidence, gamma)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    eligible = None
    if caps is not None:
        if caps.shape != (num_req,) or caps.dtype != torch.int64:
            raise ValueError(f"caps must be int64 [{num_req}], got {caps.dtype} {tuple(caps.shape)}")
        positions = torch.arange(gamma, device=confidence.device)
        eligible = positions[None, :] < caps.to(confidence.device)[:, None]
    ranking = admission.rank_slots(admission.survival(confidence), eligible)
    lengths = admission.admit_first(ranking.rows, min(budget, ranking.positive), num_req)
    return (lengths + 1).to(device=confidence.device, dtype=torch.int32)


class LaggedBudgetPlanner:
    """Drop-in for SGLang's ``HostConfidenceBudgetPlanner`` (same method names), computing K
    with ``capacity_from_lagged``.

    Args:
        cost_table: our ``CostTable``.
        gamma: block size.
        relay_lag_steps: steps of lag the FutureMap relay already applies (2 with the overlap
            scheduler, 0 without); the planner carries the remaining ``LAG_STEPS - relay``.
        max_batch_tokens: optional cap on B.
    """

    def __init__(self, cost_table: CostTable, gamma: int, *, relay_lag_steps: int,
                 max_batch_tokens: int | None = None):
        if not isinstance(cost_table, CostTable):
            raise TypeError(f"cost_table must be a CostTable, got {type(cost_table).__name__}")
        admission.check_gamma(gamma)
        if relay_lag_steps < 0:
            raise ValueError(f"relay_lag_steps must be >= 0, got {relay_lag_steps}")
        self.sps_table = cost_table
        self.gamma = gamma
        self.max_batch_tokens = max_batch_tokens
        self.lag_steps = LAG_STEPS
        self.relay_lag_steps = relay_lag_steps
        self.carry_steps = max(LAG_STEPS - relay_lag_steps, 0)
        self.forced_budget_frac: float | None = None
        self.last_decision: BudgetDecision | None = None
        # Per carried step: (pool indices [R'], confidence [R', gamma], generation [R']).
        self._carry: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # Pool slot -> (generation, decode steps seen) of the requests of the last decode step.
        self._decode_steps: dict[int, tuple[int, int]] = {}

    def compute_budget(self, *, confidence: torch.Tensor, generation: torch.Tensor,
                       current_generation: torch.Tensor,
                       req_pool_indices_cpu: torch.Tensor) -> int:
        """K for this step. ``confidence`` [R, gamma] / ``generation`` [R] int64 are the relay's
        rows (``relay_lag_steps`` old) for the current requests ``req_pool_indices_cpu`` [R];
        ``current_generation`` [R] int64 their pool slots' generation now (>= 1 when live).
        A row is history only when its generation is current, the request was in at least
        ``relay_lag_steps`` earlier decode steps (the relay has written its row) and its values
        are confidences (``capacity_from_lagged``)."""
        rows = req_pool_indices_cpu.cpu().long()
        cur = current_generation.cpu().long()
        conf, gen = self._shift(confidence.cpu().float(), generation.cpu().long(), rows)
        earlier = self._count_decode_steps(rows, cur)
        has_history = (cur >= 1) & (gen == cur) & (earlier >= self.relay_lag_steps)
        if self.forced_budget_frac is not None:
            decision = BudgetDecision(max(0, int(float(self.forced_budget_frac) * conf.numel())))
        else:
            decision = capacity_from_lagged(conf, has_history, self.sps_table,
                                            self.max_batch_tokens)
        self.last_decision = decision
        return decision.budget

    def take_last_decision(self) -> BudgetDecision | None:
        """The last decision, once (SGLang's observers consume it)."""
        decision, self.last_decision = self.last_decision, None
        return decision

    def note_non_decode_step(self) -> None:
        """A prefill/extend step: no decision this step."""
        self.last_decision = None

    def _count_decode_steps(self, rows: torch.Tensor, generation: torch.Tensor) -> torch.Tensor:
        """[R] int64 earlier decode steps of each current request (its pool slot at its current
        generation); records this step."""
        earlier = []
        steps = {}
        for slot, gen in zip(rows.tolist(), generation.tolist()):
            seen_gen, seen = self._decode_steps.get(slot, (None, 0))
            count = seen if seen_gen == gen else 0
            earlier.append(count)
            steps[slot] = (gen, count + 1)
        self._decode_steps = steps
        return torch.tensor(earlier, dtype=torch.int64)

    def _shift(self, conf: torch.Tensor, gen: torch.Tensor, rows: torch.Tensor):
        if self.carry_steps == 0:
            return conf, gen
        self._carry.append((rows, conf, gen))
        if len(self._carry) <= self.carry_steps:
            return torch.ones_like(conf), torch.zeros_like(gen)
        old_rows, old_conf, old_gen = self._carry.pop(0)
        # Row lookup by pool index; rows absent from the old step get generation 0 (no history).
        match = rows[:, None] == old_rows[None, :]
        found = match.any(dim=1)
        where = match.float().argmax(dim=1)
        lagged_conf = torch.where(found[:, None], old_conf[where] if old_rows.numel() else
                                  torch.ones_like(conf), torch.ones_like(conf))
        lagged_gen = torch.where(found, old_gen[where] if old_rows.numel() else
                                 torch.zeros_like(gen), torch.zeros_like(gen))
        return lagged_conf, lagged_gen
