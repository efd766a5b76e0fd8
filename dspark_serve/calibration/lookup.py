"""Calibrated survival of prompt-lookup drafts, so the hardware-aware scheduler ranks lookup
and drafter tokens in one pool (hybrid drafting; issue 15).

A lookup draft has no confidence head; what predicts its acceptance is the length m of the
matched suffix and the position k. The calibration is a table of conditional survival
c[m, k] = P(draft k accepted | drafts 1..k-1 accepted, match length m), m capped at
``max_match``, fitted like STS on held-out rounds with real outcomes: per (m, k) the accepted
count over the reached count with a Beta(1, 1) prior (Laplace), so unseen cells are 0.5.
Prefix survival a_k = prod_{i<=k} c[m, i], as for the drafter (paper Eq 7 + STS).

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
        if gamma > self.gamma:
            raise ValueError(f"lookup calibration covers {self.gamma} positions, gamma is {gamma}")
        table = torch.tensor(self.conditional, dtype=torch.float32,
                             device=match_len.device)[:, :gamma]
        rows = table[(match_len.clamp(min=1, max=table.shape[0]) - 1)]
        return rows * (match_len > 0)[:, None]

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
    m, d, a = (np.asarray(x, dtype=np.int64) for x in (match_len, num_drafted, num_accepted))
    if not m.shape == d.shape == a.shape or np.any(m < 1) or np.any(a > d) or np.any(a < 0):
        raise ValueError("rounds need equal lengths, match_len >= 1 and 0 <= accepted <= drafted")
    reached = np.zeros((max_match, gamma))
    accepted = np.zeros((max_match, gamma))
    row = np.minimum(m, max_match) - 1
    for k in range(gamma):
        # position k+1 is reached when it was drafted and every earlier draft accepted
        hit = (d > k) & (a >= k)
        np.add.at(reached, (row[hit], k), 1)
        np.add.at(accepted, (row[hit & (a > k)], k), 1)
    table = (accepted + 1) / (reached + 2)
    return LookupCalibration(table.round(4).tolist(), dataset, int(m.size), float(temperature))
