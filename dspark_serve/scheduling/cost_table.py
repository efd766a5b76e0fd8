"""SPS cost table: profiled engine throughput SPS(B) in steps per second at B batch tokens
(paper Section 3.2.2: "profiled once during engine initialization and stored as a lightweight
cost table"; Section 5.2 for its jagged, step-wise shape).

File format: interchangeable with SGLang 0.5.23's ``SpsCostTable`` (msgspec struct in
``sglang/srt/speculative/dspark_components/dspark_sps.py``, loaded by ``build_sps_cost_table``
in ``dspark_planner.py`` from ``--speculative-dspark-sps-table-path``). One compact JSON object::

    {"sample_batch_tokens":[B_1,...,B_n],"sample_steps_per_sec":[S_1,...,S_n],
     "max_batch_tokens":M,"meta":{...}}

- ``sample_batch_tokens``: JSON ints >= 1, strictly increasing, at least one probe.
- ``sample_steps_per_sec``: numbers (ints accepted), one per probe.
- ``max_batch_tokens``: JSON int >= the last probe.
- ``meta``: ours (device SKU, date, model, ...). SGLang ignores unknown keys, so it loads our
  files unchanged; ``meta`` is omitted when empty, giving byte-identical SGLang output.
  Unknown keys are ignored when reading, as SGLang does.

Lookup rule, where we deliberately differ from SGLang: SGLang returns the SPS of the probe at or
BELOW B (``bisect_right - 1``, clamped to the first probe) and the last probe's SPS for any B
beyond it. Right after a cliff that is the faster pre-cliff probe, so the scheduler overestimates
throughput exactly where admitting one more token is most expensive. We use the probe at or
ABOVE B (B below the first probe gets the first probe), which never claims more speed than was
measured for a batch at least as large. Beyond the last probe we extrapolate step time in
proportion to B (SPS(B) = S_n * B_n / B): for any affine step time t(B) = t0 + t1*B with t0 >= 0
this is an upper bound on the step time, hence again conservative. B > max_batch_tokens is
infeasible and gets SPS 0, so it never maximises Theta = tau * SPS(B).
Stricter than SGLang: steps/s must be finite and > 0 (SGLang accepts any float).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_KEYS = ("sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens")
META_KEY = "meta"
# SGLang's loader picks its additive table format when this substring occurs anywhere in the file.
_SGLANG_ADDITIVE_MARKER = '"bias_seconds"'


@dataclass(frozen=True)
class CostTable:
    """Profiled probes (B_i batch tokens, S_i steps/s) plus the batch-token limit.

    Raises ValueError on construction for no probes, unsorted or duplicate probes, a probe < 1,
    a probe/SPS length mismatch, non-finite or non-positive SPS, or max_batch_tokens below the
    last probe; TypeError for non-int token counts or a non-dict ``meta``.
    """

    sample_batch_tokens: tuple[int, ...]
    sample_steps_per_sec: tuple[float, ...]
    max_batch_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)
    _tensors: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _dense: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tokens = tuple(_int(f"sample_batch_tokens[{i}]", b)
                       for i, b in enumerate(self.sample_batch_tokens))
        sps = tuple(_float(f"sample_steps_per_sec[{i}]", s)
                    for i, s in enumerate(self.sample_steps_per_sec))
        object.__setattr__(self, "sample_batch_tokens", tokens)
        object.__setattr__(self, "sample_steps_per_sec", sps)
        _int("max_batch_tokens", self.max_batch_tokens)
        if not tokens:
            raise ValueError("CostTable requires at least one probe")
        if len(tokens) != len(sps):
            raise ValueError(f"sample_batch_tokens and sample_steps_per_sec differ in length: "
                             f"{len(tokens)} vs {len(sps)}")
        if tokens[0] < 1:
            raise ValueError(f"probe batch tokens must be >= 1, got {tokens[0]}")
        if any(b >= nxt for b, nxt in zip(tokens, tokens[1:])):
            raise ValueError(f"sample_batch_tokens must be strictly increasing, got {list(tokens)}")
        if any(not math.isfinite(s) or s <= 0 for s in sps):
            raise ValueError(f"sample_steps_per_sec must be finite and > 0, got {list(sps)}")
        if self.max_batch_tokens < tokens[-1]:
            raise ValueError(f"max_batch_tokens must be >= the largest probe, got "
                             f"{self.max_batch_tokens} < {tokens[-1]}")
        if not isinstance(self.meta, dict):
            raise TypeError(f"meta must be a dict, got {type(self.meta).__name__}")

    @classmethod
    def from_step_times(cls, batch_tokens: list[int], step_seconds: list[float], *,
                        max_batch_tokens: int | None = None,
                        meta: dict[str, Any] | None = None) -> "CostTable":
        """Table from measured step times (seconds per forward at each B), SPS = 1 / time.
        ``max_batch_tokens`` defaults to the last probe, as SGLang's ``profile_sps_table``.
        Raises ValueError for a non-positive time, plus the constructor's errors."""
        if any(not t > 0 for t in step_seconds):
            raise ValueError(f"step times must be > 0 seconds, got {list(step_seconds)}")
        limit = max_batch_tokens if max_batch_tokens is not None else max(batch_tokens, default=0)
        return cls(tuple(batch_tokens), tuple(1.0 / t for t in step_seconds), limit,
                   dict(meta or {}))

    def sps(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        """SPS(B) in steps/s: the probe at or above B, proportional step time beyond the last
        probe, 0 above ``max_batch_tokens`` (see module docstring for why).

        Args:
            batch_tokens: int64 tensor of any shape, every B >= 1.
        Returns:
            float64 tensor of the same shape and device.
        Raises:
            TypeError: not an int64 tensor. ValueError: some B < 1.
        """
        if not isinstance(batch_tokens, torch.Tensor) or batch_tokens.dtype != torch.int64:
            raise TypeError("batch_tokens must be an int64 tensor")
        if batch_tokens.numel() and bool((batch_tokens < 1).any()):
            raise ValueError("batch_tokens must all be >= 1")
        probes, values = self._on(batch_tokens.device)
        last = probes.numel() - 1
        idx = torch.bucketize(batch_tokens, probes)          # first probe >= B, or last + 1
        at_or_above = values[idx.clamp(max=last)]
        extrapolated = values[last] * probes[last].double() / batch_tokens.double()
        out = torch.where(idx > last, extrapolated, at_or_above)
        return out.masked_fill(batch_tokens > self.max_batch_tokens, 0.0)

    def sps_range(self, start: int, stop: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """SPS(B) for the consecutive batch sizes B = start..stop-1, as ``sps`` would return
        them, but sliced from a dense table cached per device (the schedulers' hot path).

        Returns float64 [stop - start]. Raises ValueError unless 1 <= start <= stop.
        """
        if not 1 <= start <= stop:
            raise ValueError(f"need 1 <= start <= stop, got start={start}, stop={stop}")
        device = torch.device(device)
        feasible_stop = min(stop, self.max_batch_tokens + 1)
        dense = self._dense.get(device)
        if dense is None or dense.numel() < feasible_stop:
            # Grow geometrically so a slowly rising B does not rebuild every step.
            size = min(max(feasible_stop, 2 * (0 if dense is None else dense.numel()), 64),
                       self.max_batch_tokens + 1)
            batch = torch.arange(1, size, dtype=torch.int64, device=device)
            dense = torch.cat([batch.new_zeros(1, dtype=torch.float64), self.sps(batch)])
            self._dense[device] = dense
        out = dense[start:feasible_stop]
        if feasible_stop < stop:
            out = torch.cat([out, out.new_zeros(stop - max(start, feasible_stop))])
        return out

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Built once per device: schedulers call sps() every step.
        if device not in self._tensors:
            self._tensors[device] = (
                torch.tensor(self.sample_batch_tokens, dtype=torch.int64, device=device),
                torch.tensor(self.sample_steps_per_sec, dtype=torch.float64, device=device))
        return self._tensors[device]

    def to_json(self) -> str:
        """Compact JSON in SGLang's key order, then ``meta`` when non-empty.
        Raises ValueError if ``meta`` is not JSON-serialisable or contains ``"bias_seconds"``
        (SGLang would then misread the file as its additive table format)."""
        obj: dict[str, Any] = {"sample_batch_tokens": list(self.sample_batch_tokens),
                               "sample_steps_per_sec": list(self.sample_steps_per_sec),
                               "max_batch_tokens": self.max_batch_tokens}
        if self.meta:
            obj[META_KEY] = self.meta
        try:
            text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cost table meta is not JSON-serialisable: {exc}") from exc
        if _SGLANG_ADDITIVE_MARKER in text:
            raise ValueError(f"meta must not contain {_SGLANG_ADDITIVE_MARKER}: SGLang would load "
                             "the file as an SpsAdditiveCostTable")
        return text

    @classmethod
    def from_json(cls, text: str) -> "CostTable":
        """Parse an SGLang ``SpsCostTable`` (or our) JSON string. Raises ValueError for invalid
        JSON, a non-object, a missing key, SGLang's additive table, or invalid values."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost table is not valid JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise ValueError(f"cost table JSON must be an object, got {type(obj).__name__}")
        if "bias_seconds" in obj:
            raise ValueError("SGLang SpsAdditiveCostTable files are not supported; "
                             "profile an SpsCostTable (batch tokens -> steps/s)")
        missing = [k for k in _KEYS if k not in obj]
        if missing:
            raise ValueError(f"cost table JSON is missing required keys {missing}")
        for key in _KEYS[:2]:
            if not isinstance(obj[key], list):
                raise ValueError(f"{key} must be a JSON list, got {type(obj[key]).__name__}")
        try:
            return cls(tuple(obj["sample_batch_tokens"]), tuple(obj["sample_steps_per_sec"]),
                       obj["max_batch_tokens"], obj.get(META_KEY, {}))
        except TypeError as exc:
            raise ValueError(f"invalid cost table JSON: {exc}") from exc

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        """Read a cost table file (see ``from_json``)."""
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def save(self, path: str | Path) -> None:
        """Write the table as SGLang-loadable JSON (see ``to_json``)."""
        Path(path).write_text(self.to_json(), encoding="utf-8")


def _int(name: str, value: Any) -> int:
    # JSON 1.0 is a float; SGLang (msgspec) rejects it for int fields, and so do we.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)
