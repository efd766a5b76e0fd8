"""Calibrated survival of prompt-lookup drafts, so the hardware-aware scheduler ranks lookup
and drafter tokens in one pool (hybrid drafting; issue 15).

A lookup draft has no confidence head; what predicts its acceptance is the length m of the
matched suffix and the position k. The calibration is a table of conditional survival
c[m, k] = P(draft k accepted | drafts 1..k-1 accepted, match length m), m capped at
``max_match``, fitted like STS on held-out rounds with real outcomes: per (m, k) the accepted
count over the reached count with a Beta(1, 1) prior (Laplace), so unseen cells are 0.5.
Prefix survival a_k = prod_{i<=k} c[m, i], as for the drafter (paper Eq 7 + STS).

While serving, ``OnlineLookupSurvival`` keeps following the outcomes: the fitted table is only
a prior, because acceptance depends on the traffic (the shipped table, fitted on ShareGPT
answers, predicts conditional survival 0.55-0.82 at positions 2-3 where MT-Bench answers give
0.40 / 0.33), and an overestimate makes the scheduler verify tokens that do not pay. The prior
itself moves too: one logit shift for the whole table, fitted to every served outcome, so a cell
the traffic rarely reaches (long matches, late positions) follows what the others learned
instead of keeping the fitted value for its first few dozen rounds (measured, prompt lookup at
16 users, its first 48 MT-Bench requests on a fresh engine: 852 accepted drafts predicted and
698 accepted without the shift, 767-806 predicted and ~695 accepted with it).

File (``lookup_calibration.json``)::

    {"conditional": [[c_11, ..., c_1gamma], ...], "dataset": "...", "num_rounds": N,
     "temperature": T}
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FILE_NAME = "lookup_calibration.json"
# Weight of the fitted table while serving, in rounds per (match length, position) cell: the
# served outcomes dominate a cell after a few dozen rounds.
PRIOR_ROUNDS = 20.0
# Standard deviation (logits) of the Gaussian prior on the table's shift: the fitted table is
# right until a handful of served outcomes say otherwise.
SHIFT_SD = 1.0


@dataclass(frozen=True)
class LookupCalibration:
    """conditional: max_match rows x gamma columns, row m-1 = match length m (longer matches
    use the last row), values in (0, 1). dataset, num_rounds, temperature: provenance."""

    conditional: list[list[float]]
    dataset: str = ""
    num_rounds: int = 0
    temperature: float = 0.0

    def __post_init__(self) -> None:
        table = np.asarray(self.conditional, dtype=np.float64)
        if table.ndim != 2 or 0 in table.shape or not np.all((table >= 0) & (table <= 1)):
            raise ValueError("conditional must be a non-empty [max_match, gamma] table of "
                             "values in [0, 1]")

    @property
    def gamma(self) -> int:
        return len(self.conditional[0])

    def confidence(self, match_len: torch.Tensor, gamma: int) -> torch.Tensor:
        """Conditional survival [R, gamma] float32 for match lengths [R] int64 (0 = no draft:
        all zeros). Raises ValueError if gamma exceeds the table's."""
        return _survival_rows(torch.tensor(self.conditional, dtype=torch.float32), match_len,
                              gamma)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.__dict__, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "LookupCalibration":
        """Raises ValueError for a malformed file."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(**data)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a lookup calibration file ({exc})") from exc


def fit_lookup_calibration(match_len: np.ndarray, num_drafted: np.ndarray,
                           num_accepted: np.ndarray, gamma: int, max_match: int, *,
                           dataset: str = "", temperature: float = 0.0) -> LookupCalibration:
    """Fit the table from rounds (module docstring).

    Args:
        match_len, num_drafted, num_accepted: [N] int per round with a draft (m >= 1, drafts
            verified, drafts accepted <= drafted).
        gamma: table width; max_match: table height.
    Raises:
        ValueError: mismatched lengths or impossible counts.
    """
    reached, accepted = _count_rounds(match_len, num_drafted, num_accepted, gamma, max_match)
    table = (accepted + 1) / (reached + 2)
    return LookupCalibration(table.round(4).tolist(), dataset, int(np.size(match_len)),
                             float(temperature))


def _survival_rows(table: torch.Tensor, match_len: torch.Tensor, gamma: int) -> torch.Tensor:
    """Rows of a [max_match, >= gamma] table for match lengths [R] (0: zeros), on their device."""
    if gamma > table.shape[1]:
        raise ValueError(f"lookup calibration covers {table.shape[1]} positions, gamma is {gamma}")
    table = table[:, :gamma].to(match_len.device)
    rows = table[(match_len.clamp(min=1, max=table.shape[0]) - 1)]
    return rows * (match_len > 0)[:, None]


def _count_rounds(match_len, num_drafted, num_accepted, gamma: int,
                  max_match: int) -> tuple[np.ndarray, np.ndarray]:
    """[max_match, gamma] float64 counts of rounds that reached position k+1 (drafted there and
    every earlier draft accepted) and of those accepted there. Raises ValueError as
    ``fit_lookup_calibration``."""
    m, d, a = (np.asarray(x, dtype=np.int64) for x in (match_len, num_drafted, num_accepted))
    if not m.shape == d.shape == a.shape or np.any(m < 1) or np.any(a > d) or np.any(a < 0):
        raise ValueError("rounds need equal lengths, match_len >= 1 and 0 <= accepted <= drafted")
    reached = np.zeros((max_match, gamma))
    accepted = np.zeros((max_match, gamma))
    row = np.minimum(m, max_match) - 1
    for k in range(gamma):
        hit = (d > k) & (a >= k)
        np.add.at(reached, (row[hit], k), 1)
        np.add.at(accepted, (row[hit & (a > k)], k), 1)
    return reached, accepted


class OnlineLookupSurvival:
    """Conditional survival of lookup drafts that follows served outcomes (module docstring).

    Per (match length, position) cell: (prior_rounds * shifted + accepted) / (prior_rounds +
    reached), the prior worth ``prior_rounds`` rounds, the counts those of every verified
    lookup round so far, and shifted = sigmoid(logit(prior) + b) with b the maximum a
    posteriori shift of all cells' counts under a N(0, SHIFT_SD^2) prior on b (Platt-style
    intercept recalibration: sum_c reached_c * shifted_c + b / SHIFT_SD^2 = sum_c
    accepted_c). Lossless: a round's survival, hence its verify length, depends only on
    earlier rounds' outcomes, never on its own target sample.

    Args:
        prior: [max_match, gamma] float conditional survival (``LookupCalibration.conditional``
            or a constant guess); match lengths past max_match use the last row.
        prior_rounds: weight of the prior, in rounds per cell (> 0).
    Raises:
        ValueError: a prior that is not a non-empty table of values in [0, 1], prior_rounds <= 0.
    """

    def __init__(self, prior: list[list[float]], prior_rounds: float = PRIOR_ROUNDS):
        LookupCalibration(prior)   # validates the table
        if prior_rounds <= 0:
            raise ValueError(f"prior_rounds must be > 0, got {prior_rounds}")
        p = np.clip(np.asarray(prior, dtype=np.float64), 1e-9, 1 - 1e-9)
        self._prior_logit = np.log(p) - np.log1p(-p)
        self._weight = prior_rounds
        self.shift = 0.0
        self.reached = np.zeros_like(p)
        self.accepted = np.zeros_like(p)
        self._table: torch.Tensor | None = None
        self._best: dict[int, torch.Tensor] = {}    # best_case per gamma, until observe

    @property
    def gamma(self) -> int:
        return self._prior_logit.shape[1]

    def table(self) -> torch.Tensor:
        """[max_match, gamma] float32 current conditional survival."""
        if self._table is None:
            shifted = _sigmoid(self._prior_logit + self.shift)
            self._table = torch.from_numpy((self._weight * shifted + self.accepted)
                                           / (self._weight + self.reached)).float()
        return self._table

    def confidence(self, match_len: torch.Tensor, gamma: int) -> torch.Tensor:
        """[R, gamma] float32 for match lengths [R] int64 (0 = no draft: zeros), as
        ``LookupCalibration.confidence``. Raises ValueError if gamma exceeds the table's."""
        return _survival_rows(self.table(), match_len, gamma)

    def best_case(self, gamma: int) -> torch.Tensor:
        """[gamma] float32 conditional survival of a row at least as likely to survive as any
        match length's, at every position: its survival a_k is the largest a_k of the table's
        rows (an upper bound for deciding whether lookup can pay at all). Cached until the
        next ``observe`` (asked every step)."""
        if gamma not in self._best:
            cum = self.table()[:, :gamma].double().cumprod(1).amax(0)
            self._best[gamma] = (cum / torch.cat([cum.new_ones(1), cum[:-1]]).clamp(min=1e-12)
                                 ).clamp(0, 1).float()
        return self._best[gamma]

    def observe(self, match_len, num_verified, num_accepted) -> None:
        """Count verified rounds: [N] int match lengths (>= 1), drafts verified, drafts
        accepted (<= verified). Raises ValueError for impossible counts."""
        reached, accepted = _count_rounds(match_len, num_verified, num_accepted, self.gamma,
                                          self._prior_logit.shape[0])
        self.reached += reached
        self.accepted += accepted
        self.shift = self._fit_shift()
        self._table = None
        self._best.clear()

    def _fit_shift(self) -> float:
        """The MAP logit shift b (class docstring) by Newton's method from the last one (the
        log posterior is concave in b; steps capped at 2 logits)."""
        b, seen = self.shift, self.reached > 0
        logit, reached, target = self._prior_logit[seen], self.reached[seen], self.accepted.sum()
        for _ in range(50):
            p = _sigmoid(logit + b)
            grad = target - float(reached @ p) - b / SHIFT_SD ** 2
            hess = float(reached @ (p * (1 - p))) + 1 / SHIFT_SD ** 2
            step = float(np.clip(grad / hess, -2.0, 2.0))
            b += step
            if abs(step) < 1e-9:
                break
        return b


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
