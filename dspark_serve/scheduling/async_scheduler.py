"""Asynchronous hardware-aware prefix scheduler (paper Section 5.2).

Two decisions per step t, taken from different information:

- Capacity K (draft tokens to verify, B = R + K): from the survival probabilities of step t-2,
  by an unconstrained global search, K = argmax_k Theta_k over every prefix count k of that
  step's ranking (no early stop, so the search crosses SPS cliffs). With zero-overhead
  scheduling the batch size of step t must be known while step t-1 still runs, so step t-2 is
  the newest finished step; ``capacity(R)`` exposes K before step t's drafts exist.
- Admission: step t's slots ranked by their own, up-to-date survival; the top K are verified
  (dynamic top-K, prefix-respecting; zero-survival slots are never admitted).

Lossless: K depends only on steps <= t-2 and on R (known before drafting), never on step t's
tokens, and top-K admission is non-anticipating (``admission`` module). The retrospective
search on the current step's own survival would not be (paper Appendix A).

Choices the paper leaves open:
- R changes between steps (requests join or leave): K is a count, and the old step only
  contributes its ranked survival values, so we stretch that ranking to the current R, as if
  each old request were repeated R/R' times: tau_k = R + (R/R') * S'(k R'/R), with S' the old
  cumulative survival, linearly interpolated. For R = R' this is exactly the old search.
  Request identity is not tracked (nor needed: only the sorted pool matters).
- First two steps (no step t-2 yet): every slot is assumed to survive (a = 1), SGLang's
  convention for requests without history, so K maximises raw token throughput
  (R + k) * SPS(R + k) under the cost table.
- A step with R = 0 returns no lengths and records no history.

Beyond the paper: rows whose survival is known before drafting. A prompt-lookup row (hybrid
and ngram proposers) copies its drafts from the request's committed text and gets its
survival from its match length, so both are fixed before step t drafts anything; ``known``
marks such rows. K is then searched over one pool: the known rows' survival of step t itself
and the lagged drafter survival stretched to the other rows. Still lossless: nothing in it
depends on a token drafted at step t. Only drafter rows enter the history. (With lags,
lookup rows, whose matches come and go from step to step, were rarely verified.)

Beyond the paper: the drafter's own time. SPS(B) prices the target forward only, but a step
that drafts also pays the drafter (measured: ~30 ms next to a ~50 ms one-token target forward
for SmolLM2-135M on a 2-core CPU). The engine reports each draft's wall time
(``observe_draft``); K then maximises (R + S_K) / (1 / SPS(R + K) + d_R), d_R the drafting
seconds for R requests, and ``worth_drafting`` skips drafting step t altogether (a plain
decode step, Theta_0 = R * SPS(R)) when no K beats it. Both read the same survival history as
K, so they stay lossless; while drafting is off no new survival arrives, so a skipped step
drafts anyway (a probe) after ``PROBE_INTERVAL`` skipped steps, then after twice as many each
time drafting still does not pay (up to ``MAX_PROBE_INTERVAL``; back to ``PROBE_INTERVAL`` once
it does): a probe costs a whole draft plus a verify (measured: fixed probes every 16 steps
made plain serving ~10 % slower on a 2-core CPU). Where the drafter pays, this changes nothing;
where it cannot (a weak drafter, a CPU), serving falls back to plain decoding instead of
running slower than it.

Beyond the paper: the draft's width. K is known before step t drafts, and no row can verify
more than K drafts, so the drafter drafts min(gamma, K + 1) positions (``draft_width``; the
block cut to them): the extra position's survival lets K grow by one per drafted step, since
only drafted positions enter the history. A narrower block costs less (one request on a
2-core CPU: 3 of SmolLM2's 7 positions ~1.3 against ~1.9 ms with the drafter's weights in
cache, 2.7 against 3.4 ms read from memory as served; position-1 acceptance of the cut block
within ~0.015 of the whole block's), and the drafting time is kept per width, so each K is
priced with the width it drafts. Lossless: the width is a function of K.

Beyond the paper: proposing must pay for itself. Prompt lookup, drafting and the scheduling
around them cost wall time in every step that proposes (measured: ~1 ms of a ~31 ms step at 16
users on a 2-core CPU), while a verified draft token there costs about as much as it saves, so
16-user prompt lookup served 3 % fewer tokens/s than plain decoding. The engine reports each
proposing step's outcome (``observe_proposal``); its net gain is the seconds it saved under the
step prices (accepted drafts at a plain step's price per token, less the verify batch's extra
price) less the seconds proposing took. ``proposing_pays`` keeps proposing while the average
net gain at this R loses at most ``PROPOSAL_MARGIN`` of a plain step, else makes steps plain
decoding, proposing after ``PROPOSAL_PROBE_INTERVAL`` of them (a probe, weighing in the average
as the steps it stands for), then after twice as many each time proposing still does not pay
(up to ``MAX_PROPOSAL_PROBE_INTERVAL``: a 16-user probe cost ~24 ms beside a ~31 ms plain step,
and probes every 16 steps ~1 % of such serving). The average's memory counts requests'
rounds, not steps: a step of R requests weighs as R rounds, so 16 users decide after ~13
steps, as one user does after 200 (with a memory in steps, 16-user serving kept proposing at
a loss for 200 steps, most of a benchmark cell). The margin and the memory keep prompt lookup
at one user, whose gains come in bursts and whose steps without a match cost ~0.05 ms of ~8:
a gate on short windows closed between bursts. Lossless: finished steps only.

Beyond the paper: served step times. The engine reports each decode step's wall time outside
drafting (``observe_step``), and SPS(B) is the profile corrected by them
(``step_cost.MeasuredStepCost``), so a profile that made verification look cheap stops
buying draft tokens that do not pay. Lossless for the same reason: finished steps only.
"""
from __future__ import annotations

from collections import deque

import torch

from dspark_serve.scheduling import admission
from dspark_serve.scheduling.cost_table import CostTable
from dspark_serve.scheduling.step_cost import MeasuredStepCost

# Steps between the survival used for K and the step it schedules (zero-overhead scheduling).
LAG_STEPS = 2
# A step drafts after this many consecutive steps without drafting (refreshes the survival);
# the interval doubles after each probe up to MAX_PROBE_INTERVAL while drafting does not pay.
PROBE_INTERVAL = 16
MAX_PROBE_INTERVAL = 256
# Weight of the newest measurement in the drafting-time average.
DRAFT_TIME_EMA = 0.25
# Weight of one request's round in the average net gain of proposing (~200 rounds of memory:
# 200 steps at one user, ~13 at 16; the plain mean until that many are recorded), the loss (a
# fraction of a plain step's time) it may show before steps stop proposing, and the plain
# steps between proposals then (probes; doubling up to the maximum while proposing loses).
PROPOSAL_EMA = 0.005
PROPOSAL_MARGIN = 0.01
PROPOSAL_PROBE_INTERVAL = 16
MAX_PROPOSAL_PROBE_INTERVAL = 64


class AsyncScheduler:
    """Section 5.2 scheduler as a stateful callable ``confidence [R, gamma] -> lengths [R]``.

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
        self.step_cost = MeasuredStepCost(cost_table)
        self.max_batch_tokens = max_batch_tokens
        # Per past drafted step: (R', cumulative ranked survival [R'*gamma + 1] f64,
        # #slots with a > 0).
        self._history: deque[tuple[int, torch.Tensor, int]] = deque(maxlen=LAG_STEPS)
        # R -> width -> moving average of the seconds drafting R blocks of width positions,
        # and R -> [gamma] float64 the estimates by width 1..gamma (``_draft_overheads``)
        self._draft_seconds: dict[int, dict[int, float]] = {}
        self._overheads: dict[int, torch.Tensor] = {}
        self._skipped = 0
        self._probe_interval = PROBE_INTERVAL
        # worth_drafting's answers: (R, known rows) -> pays, for the state versions in
        # _pays_versions. Without known rows the answer changes only with R, the history, the
        # drafting times or the step prices (new versions), so the steps between drafts (most
        # steps where drafting does not pay) reuse it; with known rows it also reuses the
        # answer for the same number of them (their survival moves it little; recomputing it
        # cost ~0.15 ms, ~1 % of a 4-user CPU step, and a single cached answer missed whenever
        # the split between lookup and drafter rows changed, most hybrid steps at 4 users).
        self._version = 0
        self._pays: dict[tuple[int, int], bool] = {}
        self._pays_versions: tuple[int, int] | None = None
        self._verify_pays: tuple[tuple, bool] | None = None   # verifying_pays' last answer
        # R -> (moving average of the net gain, rounds recorded) of the steps that proposed
        self._proposals: dict[int, tuple[float, int]] = {}
        self._plain_steps = 0     # steps since the last proposal that proposing_pays refused
        self._proposal_probe_interval = PROPOSAL_PROBE_INTERVAL
        self._represents = 1      # steps the next observed proposal stands for (a probe: more)

    def reset(self) -> None:
        """Forget the history, the drafting and the served step times (a new, unrelated run
        starts)."""
        self._history.clear()
        self._draft_seconds.clear()
        self._overheads.clear()
        self.step_cost = MeasuredStepCost(self.cost_table)
        self._skipped = 0
        self._probe_interval = PROBE_INTERVAL
        self._proposals.clear()
        self._plain_steps, self._represents = 0, 1
        self._proposal_probe_interval = PROPOSAL_PROBE_INTERVAL
        self._version += 1

    def observe_draft(self, num_requests: int, seconds: float, width: int | None = None) -> None:
        """Record the wall time (seconds) of drafting blocks of ``width`` draft positions
        (None: gamma) for ``num_requests`` requests."""
        self._version += 1
        self._overheads.clear()
        widths = self._draft_seconds.setdefault(num_requests, {})
        width = self.gamma if width is None else width
        old = widths.get(width)
        widths[width] = seconds if old is None else old + DRAFT_TIME_EMA * (seconds - old)

    def observe_step(self, batch_tokens: int, seconds: float) -> None:
        """Record a served decode step: B target positions (R + verified drafts, no prefill)
        and its wall time outside drafting, in seconds (``MeasuredStepCost.observe``)."""
        self.step_cost.observe(batch_tokens, seconds)

    def observe_proposal(self, num_requests: int, verified: int, accepted: int,
                         seconds: float) -> None:
        """Record a step that proposed for its R decoding requests: ``verified`` draft tokens
        verified, ``accepted`` of them accepted, ``seconds`` spent proposing (prompt lookup,
        drafting, scheduling). Its net gain, a fraction of a plain step: (accepted * price(R)
        / R - (price(R + verified) - price(R)) - seconds) / price(R), price(B) = 1 / SPS(B)
        as served (module docstring). It weighs as R rounds, a probe as R rounds for each
        step it stands for, each round as one step of the plain mean (until 1 /
        PROPOSAL_EMA rounds), then of the moving average. Steps with a verify batch beyond
        the cost table are ignored."""
        if num_requests <= 0:
            return
        sps = self.step_cost.sps_range(num_requests, num_requests + verified + 1)
        plain, verify = float(sps[0]), float(sps[-1])
        if not (plain > 0 and verify > 0):
            return
        net = accepted / num_requests - plain / verify + 1.0 - seconds * plain
        old, seen = self._proposals.get(num_requests, (net, 0))
        rounds = num_requests * self._represents
        self._represents = 1
        # the plain mean over the first 1 / PROPOSAL_EMA rounds: as an EMA from the first
        # value, one slow early step (a first draft: ~30 ms at one user) kept 37 % of its
        # weight after 200 steps and closed the gate at one user for hundreds of steps
        weight = max(1 - (1 - PROPOSAL_EMA) ** rounds, rounds / (seen + rounds))
        self._proposals[num_requests] = (old + weight * (net - old), seen + rounds)

    def proposing_pays(self, num_requests: int) -> bool:
        """Whether step t proposes for its R decoding requests: yes until some R has 1 /
        PROPOSAL_EMA rounds recorded (the average's memory), then while the average net gain
        at the nearest such R stays above -PROPOSAL_MARGIN of a plain step;
        otherwise a probe after ``PROPOSAL_PROBE_INTERVAL`` plain decoding steps, then after
        twice as many each time, up to ``MAX_PROPOSAL_PROBE_INTERVAL``."""
        known = [r for r, (_, seen) in self._proposals.items() if seen >= 1 / PROPOSAL_EMA]
        if num_requests <= 0 or not known:
            return True
        net = self._proposals[min(known, key=lambda r: (abs(r - num_requests), r))][0]
        if net >= -PROPOSAL_MARGIN:
            self._plain_steps, self._proposal_probe_interval = 0, PROPOSAL_PROBE_INTERVAL
            return True
        self._plain_steps += 1
        if self._plain_steps >= self._proposal_probe_interval:
            self._represents, self._plain_steps = self._plain_steps, 0
            self._proposal_probe_interval = min(2 * self._proposal_probe_interval,
                                                MAX_PROPOSAL_PROBE_INTERVAL)
            return True
        return False

    def draft_seconds(self, num_requests: int, width: int | None = None) -> float:
        """Estimated seconds drafting R blocks of ``width`` draft positions (None: gamma):
        the average measured at the nearest R, among its widths the nearest (ties: the
        smaller). 0 before any measurement, so the first steps draft and measure; 0 for R =
        0: a step whose rows are all prompt lookup's does not run the drafter, and a phantom
        drafting time added to every K's step time made verifying look cheap, so the default
        hybrid verified 2x the lookup steps that ngram did at one user."""
        if not self._draft_seconds or num_requests <= 0:
            return 0.0
        return float(self._draft_overheads(num_requests)[(width or self.gamma) - 1])

    def _draft_overheads(self, num_requests: int) -> torch.Tensor:
        """[gamma] float64 ``draft_seconds`` of R >= 1 requests by width 1..gamma (cached until
        the next ``observe_draft``; needs a measurement)."""
        cached = self._overheads.get(num_requests)
        if cached is None:
            widths = self._draft_seconds[min(self._draft_seconds,
                                             key=lambda r: (abs(r - num_requests), r))]
            cached = self._overheads[num_requests] = torch.tensor(
                [widths[min(widths, key=lambda w: (abs(w - width), w))]
                 for width in range(1, self.gamma + 1)], dtype=torch.float64)
        return cached

    def draft_width(self, num_drafted: int, known: torch.Tensor | None = None) -> int:
        """Draft positions worth drafting this step for R_d drafter rows: K + 1 (at most
        gamma), K the capacity ``__call__`` will admit with the same ``known`` rows ([R_k,
        gamma] survival, or None): no row may verify more than K drafts, and the position
        after them measures whether a larger K would pay (survival is recorded for drafted
        positions only, so K can grow by one position per drafted step). Lossless: K reads
        finished steps and R only."""
        if num_drafted <= 0:
            return self.gamma
        return min(self.gamma, self._capacity(num_drafted, _known_values(known)) + 1)

    def worth_drafting(self, num_requests: int, known: torch.Tensor | None = None) -> bool:
        """Whether step t should run the drafter (module docstring): some K >= 1 with the
        drafter's rows beats the best step without them (a plain decode step, or verifying
        only the known rows) under the drafting time, or a probe is due. Counts skipped steps
        and lengthens the probe interval.

        Args:
            num_requests: R_d, the requests the drafter would draft for.
            known: [R_k, gamma] float conditional survival of the step's other rows, known
                before drafting (prompt lookup), or None (no other rows).
        """
        if num_requests <= 0 or len(self._history) < LAG_STEPS:
            return True
        versions = (self._version, self.step_cost.version)
        if versions != self._pays_versions:
            self._pays, self._pays_versions = {}, versions
        key = (num_requests, 0 if known is None else known.shape[0])
        pays = self._pays.get(key)
        if pays is None:
            known_values = _known_values(known)
            theta = self._theta(num_requests, known_values)
            best_without = float(self._theta(num_requests, known_values, drafting=False).max())
            pays = self._pays[key] = theta.numel() > 1 and float(theta[1:].max()) > best_without
        if pays:
            self._skipped = 0
            self._probe_interval = PROBE_INTERVAL
            return True
        self._skipped += 1
        if self._skipped >= self._probe_interval:
            self._skipped = 0
            self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL)
            return True
        return False

    def verifying_pays(self, num_requests: int, best_case: torch.Tensor) -> bool:
        """Whether verifying any draft can beat a plain decode step of R requests if every
        row's drafts had the conditional survival ``best_case`` ([gamma] float, an upper
        bound: prompt lookup's best calibrated row) and cost nothing to propose. False: the
        engine proposes nothing this step (on a CPU whose step time grows about linearly in
        B, lookup drafts pay little at many users, while proposing for 16 rows costs ~1 ms of
        a ~43 ms step). Reads only the step prices and R: lossless."""
        if num_requests <= 0:
            return False
        key = (num_requests, tuple(best_case.tolist()), self.step_cost.version)
        if self._verify_pays is None or self._verify_pays[0] != key:
            known = best_case.reshape(1, -1).expand(num_requests, -1)
            theta = self._theta(0, _known_values(known))
            pays = theta.numel() > 1 and float(theta[1:].max()) > float(theta[0])
            self._verify_pays = (key, pays)
        return self._verify_pays[1]

    def capacity(self, num_requests: int) -> int:
        """K, the draft tokens step t may verify, from the survival of step t-2 (see module
        docstring); 0 <= K <= R * gamma and R + K within the batch-token limit.
        Raises ValueError when R itself exceeds the batch-token limit."""
        if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 0:
            raise ValueError(f"num_requests must be an int >= 0, got {num_requests!r}")
        if num_requests == 0:
            return 0
        return self._capacity(num_requests, _known_values(None))

    def __call__(self, confidence: torch.Tensor, known: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """Admit the top-K slots of this step and record its drafter survival for step t+2.

        Args:
            confidence: [R, gamma] float calibrated conditional survival c_{r,k} in [0, 1].
            known: optional [R] bool, rows whose survival was fixed before drafting (prompt
                lookup; module docstring): K uses their survival of this step, and they stay
                out of the history. None: every row was drafted.
        Returns:
            [R] int64 lengths in 0..gamma on the confidence's device, sum(l_r) <= K.
        Raises:
            TypeError/ValueError: bad confidence or ``known``, or R exceeds the batch-token
            limit.
        """
        admission.check_confidence(confidence, self.gamma)
        num_req = confidence.shape[0]
        if num_req == 0:
            return torch.zeros(0, dtype=torch.int64, device=confidence.device)
        if known is None:
            known = torch.zeros(num_req, dtype=torch.bool, device=confidence.device)
        elif known.dtype != torch.bool or known.shape != (num_req,):
            raise ValueError(f"known must be a bool tensor of shape ({num_req},), got "
                             f"{known.dtype} {tuple(known.shape)}")
        num_drafted = num_req - int(known.sum())
        k = self._capacity(num_drafted, _known_values(confidence[known]))
        ranking = admission.rank_slots(admission.survival(confidence))
        lengths = admission.admit_first(ranking.rows, min(k, ranking.positive), num_req)
        if num_drafted:
            drafted = (ranking if num_drafted == num_req else
                       admission.rank_slots(admission.survival(confidence[~known])))
            self._history.append((num_drafted, drafted.cum, drafted.positive))
            self._version += 1
        return lengths

    def _capacity(self, num_drafted: int, known_values: torch.Tensor) -> int:
        theta = self._theta(num_drafted, known_values)
        return int(theta.argmax())      # first maximum: the smallest K among equal throughputs

    def _theta(self, num_drafted: int, known_values: torch.Tensor,
               drafting: bool = True) -> torch.Tensor:
        """Theta_K for K = 0..max_K over R = num_drafted + known rows: the lagged drafter
        survival stretched to ``num_drafted`` rows (none without ``drafting``: those rows
        then decode one token each), merged with ``known_values`` ([n] float64 survival of
        the known rows, any order; module docstring); with drafting, each K's step also pays
        the drafting time of blocks of ``draft_width`` min(gamma, K + 1) positions."""
        num_req = num_drafted + known_values.numel() // self.gamma
        limit = admission.batch_limit(num_req, self.max_batch_tokens, self.step_cost)
        num_slots = num_drafted * self.gamma
        if not drafting or num_drafted == 0:
            cum, admissible = torch.zeros(1, dtype=torch.float64), 0
        elif len(self._history) < LAG_STEPS:
            cum, admissible = torch.arange(num_slots + 1, dtype=torch.float64), num_slots
        else:
            cum, admissible = _stretch(*self._history[0], num_drafted, num_slots)
        positive = known_values[known_values > 0]
        if positive.numel():   # one ranking: the stretched marginals and the known values
            merged = torch.cat([cum[1:admissible + 1].diff(prepend=cum[:1]), positive])
            merged = merged.sort(descending=True).values
            cum = torch.cat([merged.new_zeros(1), merged.cumsum(0)])
            admissible += positive.numel()
        max_k = admission.max_admissions(num_req, admissible, limit)
        overhead = 0.0
        if drafting and num_drafted > 0 and self._draft_seconds:
            # K's step drafts min(gamma, K + 1) positions (``draft_width``)
            overhead = self._draft_overheads(num_drafted)[
                torch.arange(max_k + 1).clamp_(max=self.gamma - 1)]
        return admission.throughput_curve(cum, num_req, max_k, self.step_cost, overhead)


def _known_values(known: torch.Tensor | None) -> torch.Tensor:
    """Survival a_{r,j} of known rows ([R_k, gamma] conditional survival, or None), flat
    [R_k * gamma] float64 on the CPU (zeros kept so the row count stays readable)."""
    if known is None:
        return torch.zeros(0, dtype=torch.float64)
    return admission.survival(known).flatten().double().cpu()


def _stretch(old_req: int, old_cum: torch.Tensor, old_admissible: int, num_req: int,
             num_slots: int) -> tuple[torch.Tensor, int]:
    """Old cumulative survival re-indexed for ``num_req`` requests: [num_slots + 1] float64
    expected accepted drafts per k, and the stretched count of admissible slots."""
    if old_req == num_req:
        return old_cum, old_admissible
    scaled = torch.arange(num_slots + 1, device=old_cum.device) * old_req
    lo = scaled // num_req
    frac = (scaled % num_req).double() / num_req
    hi = (lo + 1).clamp(max=old_cum.numel() - 1)
    cum = (old_cum[lo] + frac * (old_cum[hi] - old_cum[lo])) * (num_req / old_req)
    return cum, old_admissible * num_req // old_req
