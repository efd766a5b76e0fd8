"""STS calibration file, interchangeable with SGLang 0.5.23's ``DSparkStsCalibration``.

SGLang source: ``sglang/srt/speculative/dspark_components/dspark_sts.py`` (the msgspec struct and
``load_sts_calibration_from_path``), written by ``sglang/benchmark/dspark_sts_fit.py``, loaded by
``DSparkVerifyPlanner`` (``dspark_planner.py``) and applied by
``DSparkConfidenceHead.apply_sts`` (``sglang/srt/models/dspark.py``).

Format: one JSON object, compact (no whitespace), keys in this order::

    {"temperatures":[T_1,...,T_gamma],"dataset":"...","num_samples":N,
     "ece_before":[...],"ece_after":[...]}

- ``temperatures``: list of float, one per draft position (length gamma), required, non-empty,
  every value > 0. The logit is DIVIDED by it: ``c_k = sigmoid(z_k / T_k)`` (T > 1 softens an
  overconfident head). SGLang refuses a file whose length differs from the runtime gamma.
- ``dataset``: free text (SGLang writes the shard glob); default ``""``. Since the JSON has no
  field for the serving sampling temperature the labels were collected at, put it here.
- ``num_samples``: int, rows used by the fit; default 0.
- ``ece_before`` / ``ece_after``: per position ECE of the cumulative survival
  ``a_k = prod_{i<=k} c_i`` with all temperatures 1, and with the fitted temperatures; default ``[]``.

Fields equal to their default are omitted when writing (msgspec ``omit_defaults=True``), unknown
keys are ignored when reading, and ints are accepted where floats are expected, all as SGLang does.
Stricter than SGLang: non-finite numbers and ``ece_*`` lists whose length is neither 0 nor gamma
are rejected (SGLang's own writer never produces either).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class StsCalibration:
    """Per-position STS temperatures plus provenance (paper Section 3.2.1, post-hoc calibration).

    Raises ValueError on construction for empty or non-positive/non-finite temperatures,
    a negative ``num_samples``, or ``ece_*`` lists of the wrong length; TypeError on wrong types.
    """

    temperatures: list[float]
    dataset: str = ""
    num_samples: int = 0
    ece_before: list[float] = field(default_factory=list)
    ece_after: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperatures", _floats("temperatures", self.temperatures))
        if not self.temperatures:
            raise ValueError("StsCalibration requires at least one temperature")
        if any(t <= 0 for t in self.temperatures):
            raise ValueError(f"STS temperatures must all be > 0, got {self.temperatures}")
        if not isinstance(self.dataset, str):
            raise TypeError(f"dataset must be a str, got {type(self.dataset).__name__}")
        if isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int):
            raise TypeError(f"num_samples must be an int, got {self.num_samples!r}")
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {self.num_samples}")
        for name in ("ece_before", "ece_after"):
            values = _floats(name, getattr(self, name))
            if len(values) not in (0, self.gamma):
                raise ValueError(f"{name} has {len(values)} entries, expected 0 or gamma={self.gamma}")
            object.__setattr__(self, name, values)

    @property
    def gamma(self) -> int:
        """Block size the temperatures were fit for."""
        return len(self.temperatures)

    def temperatures_for(self, gamma: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The first ``gamma`` temperatures as a [gamma] float32 tensor.

        STS fits position k given positions 1..k-1 only (and prefix-survival labels of
        position k do not depend on later drafts), so a calibration fit for a longer block
        serves a shorter one unchanged. Raises ValueError when ``gamma`` exceeds the fitted
        positions (there is nothing to pad with)."""
        if not 1 <= gamma <= self.gamma:
            raise ValueError(f"STS calibration was fit for gamma={self.gamma} but the runtime "
                             f"gamma is {gamma}; refit it for gamma={gamma}")
        return torch.tensor(self.temperatures[:gamma], dtype=torch.float32, device=device)

    def to_json(self) -> str:
        """Compact JSON, defaults omitted, in SGLang's key order."""
        obj = {"temperatures": self.temperatures}
        if self.dataset:
            obj["dataset"] = self.dataset
        if self.num_samples:
            obj["num_samples"] = self.num_samples
        for name in ("ece_before", "ece_after"):
            if getattr(self, name):
                obj[name] = getattr(self, name)
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> "StsCalibration":
        """Parse a calibration JSON string; ValueError/TypeError on malformed content."""
        try:
            obj = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            raise ValueError(f"STS calibration is not valid JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise TypeError(f"STS calibration must be a JSON object, got {type(obj).__name__}")
        if "temperatures" not in obj:
            raise ValueError("STS calibration is missing the required key 'temperatures'")
        known = ("temperatures", "dataset", "num_samples", "ece_before", "ece_after")
        return cls(**{k: obj[k] for k in known if k in obj})


def load_sts_calibration(path: str | Path) -> StsCalibration:
    """Read a calibration file written by us or by SGLang's ``dspark_sts_fit``."""
    return StsCalibration.from_json(Path(path).read_text(encoding="utf-8"))


def save_sts_calibration(path: str | Path, calibration: StsCalibration) -> Path:
    """Write ``calibration`` so SGLang's ``--speculative-dspark-confidence-sts-path`` accepts it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(calibration.to_json(), encoding="utf-8")
    return path


def _floats(name: str, values) -> list[float]:
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of numbers, got {type(values).__name__}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must contain only numbers, got {v!r}")
        if not math.isfinite(v):
            raise ValueError(f"{name} must contain only finite numbers, got {v!r}")
        out.append(float(v))
    return out


def _reject_constant(token: str):
    raise ValueError(f"STS calibration contains the non-JSON number {token}")
