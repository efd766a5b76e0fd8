"""SPS(B) profiling: median wall time of one target forward over B new batch tokens, for a
grid of B and context lengths, turned into the scheduler's cost table (paper Section 3.2.2:
SPS "profiled once during engine initialization and stored as a lightweight cost table";
Section 5.2 on its jagged, step-wise shape, which is why the grid is dense between powers of two).

The forward is abstracted as ``step(batch_tokens, context_len)``: run one target forward with
``batch_tokens`` new tokens, each attending to ``context_len`` cached tokens, and return when
the result is ready (``dspark_serve.profiling.runner`` builds it from the embedded engine's target runner).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from tqdm.auto import tqdm

from dspark_serve.scheduling.cost_table import CostTable

StepFn = Callable[[int, int], Any]
PROFILE_META_KEY = "profile"


def batch_grid(max_batch_tokens: int, per_octave: int = 4) -> list[int]:
    """Every power of two up to ``max_batch_tokens`` plus ``per_octave - 1`` evenly spaced
    integer steps inside each octave, plus ``max_batch_tokens`` itself, ascending and unique
    (per_octave=4: 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ...).

    Raises ValueError unless max_batch_tokens >= 1 and per_octave >= 1.
    """
    if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) \
            or max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be an int >= 1, got {max_batch_tokens!r}")
    if isinstance(per_octave, bool) or not isinstance(per_octave, int) or per_octave < 1:
        raise ValueError(f"per_octave must be an int >= 1, got {per_octave!r}")
    points = {max_batch_tokens}
    p = 1
    while p <= max_batch_tokens:
        points.update(b for i in range(per_octave)
                      if (b := p * (per_octave + i) // per_octave) <= max_batch_tokens)
        p *= 2
    return sorted(points)


@dataclass(frozen=True)
class SpsProfile:
    """Median step time per (context length, batch tokens).

    batch_tokens: B probes, ascending. context_lens: context lengths profiled, ascending.
    step_seconds: context length -> median seconds per forward, aligned with batch_tokens
        (shorter than batch_tokens when a time budget stopped the sweep early).
    warmup / repeats: untimed and timed forwards per probe.
    """

    batch_tokens: tuple[int, ...]
    context_lens: tuple[int, ...]
    step_seconds: dict[int, tuple[float, ...]]
    warmup: int
    repeats: int

    def steps_per_sec(self, context_len: int) -> list[float]:
        """SPS(B) = 1 / median step time at ``context_len``, aligned with the measured probes."""
        return [1.0 / t for t in self.step_seconds[context_len]]

    def to_meta(self) -> dict[str, Any]:
        """JSON-able record of the whole profile (stored in the cost table's ``meta``)."""
        return {"context_lens": list(self.context_lens), "warmup": self.warmup,
                "repeats": self.repeats, "batch_tokens": list(self.batch_tokens),
                "step_seconds": {str(c): [float(f"{t:.6g}") for t in ts]
                                 for c, ts in self.step_seconds.items()}}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "SpsProfile":
        """Inverse of ``to_meta``; raises KeyError/ValueError on a malformed record."""
        return cls(tuple(meta["batch_tokens"]), tuple(meta["context_lens"]),
                   {int(c): tuple(ts) for c, ts in meta["step_seconds"].items()},
                   int(meta["warmup"]), int(meta["repeats"]))


def profile_sps(step: StepFn, batch_tokens: list[int], context_lens: list[int], *,
                warmup: int = 2, repeats: int = 5, sync: Callable[[], Any] | None = None,
                time_budget_s: float | None = None, progress: bool = True) -> SpsProfile:
    """Median wall time of ``step(B, C)`` for every B in ``batch_tokens`` and C in
    ``context_lens``, after ``warmup`` untimed calls per probe.

    Probes are timed in ``repeats`` rounds, each running every (B, C) once (the first B
    ascending), and a probe keeps its median over the rounds. A shared host has slow periods seconds long (other
    tenants; measured 2x step times on this project's 2-core CPU): timed probe by probe, such a
    period inflates whichever few B it overlaps and bends SPS(B), whose ratios between B's are
    what the scheduler uses; interleaved, it costs every B one round. Later rounds run B
    descending, each timed call right after an untimed one of the same probe, as a serving
    step follows steps of about its size: on a CPU a small step right after a large one is
    slow, and recovers over several steps (SmolLM2 int4, one core: B = 1 took 12 ms right
    after B = 128, 7.2 ms in a run of B = 1 steps). Timed in ascending rounds, B = 1 came out
    at 10.4-11.1 ms against 7.3-7.7 ms served, above B = 2: a 2-token verify looked as cheap
    as plain decoding, and the scheduler drafted where it lost. The first round stops
    after the first B at which ``time_budget_s / repeats`` seconds are spent, counted from the
    end of the very first warm-up (every context length measured up to that B); later rounds
    time only the probes of the first.
    ``sync`` (e.g. ``torch.cuda.synchronize``) runs after each call so asynchronous devices are
    timed to completion.

    Raises ValueError for an empty or non-positive grid, unsorted probes, repeats < 1 or
    warmup < 0.
    """
    batch_tokens, context_lens = list(batch_tokens), sorted(set(context_lens))
    if not batch_tokens or not context_lens:
        raise ValueError("need at least one batch size and one context length")
    if any(b < 1 for b in batch_tokens) or any(b >= n for b, n in zip(batch_tokens,
                                                                       batch_tokens[1:])):
        raise ValueError(f"batch_tokens must be >= 1 and strictly increasing, got {batch_tokens}")
    if any(c < 0 for c in context_lens):
        raise ValueError(f"context lengths must be >= 0, got {context_lens}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    sync = sync or (lambda: None)

    def timed(b: int, c: int) -> float:
        t0 = time.perf_counter()
        step(b, c)
        sync()
        return time.perf_counter() - t0

    samples: dict[tuple[int, int], list[float]] = {}
    measured: list[int] = []
    start = None
    bar = tqdm(total=len(batch_tokens) * len(context_lens) * repeats, desc="SPS(B)",
               unit="step", disable=not progress)
    with bar:
        for b in batch_tokens:
            for c in context_lens:
                bar.set_postfix(B=b, ctx=c)
                for _ in range(warmup):
                    timed(b, c)
                # The budget starts after the first warm-up: it holds one-time costs (first
                # touch of the weights, kernel JIT), seconds on a CPU.
                start = time.perf_counter() if start is None else start
                samples[b, c] = [timed(b, c)]
                bar.update()
            measured.append(b)
            if time_budget_s is not None and \
                    time.perf_counter() - start >= time_budget_s / repeats:
                break
        bar.total = len(samples) * repeats
        for _ in range(repeats - 1):
            for b in reversed(measured):
                for c in context_lens:
                    step(b, c)   # untimed: the timed call follows one of its own shape
                    sync()
                    samples[b, c].append(timed(b, c))
                    bar.update()
    return SpsProfile(tuple(measured), tuple(context_lens),
                      {c: tuple(statistics.median(samples[b, c]) for b in measured)
                       for c in context_lens}, warmup, repeats)


def cost_table_from_profile(profile: SpsProfile, *, context_len: int | None = None,
                            max_batch_tokens: int | None = None,
                            meta: dict[str, Any] | None = None) -> CostTable:
    """The cost table at one context length (default: the longest profiled, the slowest and so
    the conservative choice), the whole profile kept in ``meta["profile"]``.

    ``max_batch_tokens`` defaults to the largest probe; a larger value lets the table
    extrapolate (CostTable's proportional rule) past a sweep a time budget cut short.
    Raises ValueError for a context length that was not profiled.
    """
    context_len = max(profile.context_lens) if context_len is None else context_len
    if context_len not in profile.step_seconds:
        raise ValueError(f"context length {context_len} was not profiled "
                         f"(have {list(profile.context_lens)})")
    table_meta = dict(meta or {})
    table_meta["context_len"] = context_len
    table_meta[PROFILE_META_KEY] = profile.to_meta()
    return CostTable.from_step_times(list(profile.batch_tokens),
                                     list(profile.step_seconds[context_len]),
                                     max_batch_tokens=max_batch_tokens, meta=table_meta)
