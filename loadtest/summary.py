"""One sweep run (a server configuration at one concurrency) reduced to a summary row.

Aggregate output tok/s is the server's generated-token counter over the measured window when
``/metrics`` has it (exact, in-flight requests included), else the completion tokens of the
requests that finished inside the window. The verify budget per request is target positions
verified per verify round, sum(l_r + 1) / rounds (paper Figure 9, bottom row; plain decoding
has none). Per-user figures are medians over successful requests with at least two tokens.
"""
from __future__ import annotations

import statistics

SUMMARY_FIELDS = (
    "config", "concurrency", "status", "duration_s", "requests_ok", "requests_failed",
    "aggregate_tok_s", "median_tok_s_user", "p10_tok_s_user", "p90_tok_s_user",
    "median_ttft_s", "p90_ttft_s", "median_tpot_s", "median_e2e_s", "mean_completion_tokens",
    "mean_concurrency", "accepted_length", "verify_budget_per_request")


def _quantile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-quantile (q in [0, 1]); None for no values."""
    if not values:
        return None
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarize(records: list[dict], window: dict, *, config: str, concurrency: int) -> dict:
    """Summary row (``SUMMARY_FIELDS``) of one run's per-request records (``RequestRecord``
    dicts) and its window (``t_start``/``t_end`` Unix seconds, optional ``metrics_delta``).

    Raises ValueError if the window is missing or empty.
    """
    t0, t1 = window.get("t_start"), window.get("t_end")
    if t0 is None or t1 is None or t1 <= t0:
        raise ValueError(f"run window must have t_end > t_start, got {t0}, {t1}")
    duration = t1 - t0
    ok = [r for r in records if r.get("ok")]
    metrics = window.get("metrics_delta") or {}
    if "generated_tokens" in metrics:
        aggregate = metrics["generated_tokens"] / duration
    else:
        aggregate = sum(r["completion_tokens"] for r in ok if t0 <= r["t_end"] <= t1) / duration
    speeds = [r["tok_s_user"] for r in ok if r.get("tok_s_user")]
    ttfts = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    # Little's law: mean requests in flight = overlap of request lifetimes with the window / T;
    # the Locust file's own count also covers requests cut off when the window closed
    busy = sum(max(0.0, min(r["t_end"], t1) - max(r["t_start"], t0)) for r in records)
    in_flight = window.get("mean_in_flight", busy / duration)
    rounds = sum(r.get("verify_rounds") or 0 for r in ok)
    tau = (sum((r.get("accepted_tokens") or 0) + (r.get("verify_rounds") or 0) for r in ok)
           / rounds if rounds else None)
    budget = (metrics["verify_tokens"] / metrics["verify_rounds"]
              if metrics.get("verify_rounds") else None)
    return {
        "config": config, "concurrency": concurrency, "status": "ok", "duration_s": duration,
        "requests_ok": len(ok), "requests_failed": len(records) - len(ok),
        "aggregate_tok_s": aggregate,
        "median_tok_s_user": _quantile(speeds, 0.5), "p10_tok_s_user": _quantile(speeds, 0.1),
        "p90_tok_s_user": _quantile(speeds, 0.9),
        "median_ttft_s": _quantile(ttfts, 0.5), "p90_ttft_s": _quantile(ttfts, 0.9),
        "median_tpot_s": _quantile([r["tpot_s"] for r in ok if r.get("tpot_s")], 0.5),
        "median_e2e_s": _quantile([r["e2e_s"] for r in ok], 0.5),
        "mean_completion_tokens": (statistics.fmean(r["completion_tokens"] for r in ok)
                                   if ok else None),
        "mean_concurrency": in_flight, "accepted_length": tau,
        "verify_budget_per_request": budget,
    }


def failed_row(config: str, concurrency: int, status: str) -> dict:
    """Row of a run that produced no measurements (server failed to start, skipped...)."""
    row = dict.fromkeys(SUMMARY_FIELDS)
    row.update(config=config, concurrency=concurrency, status=status)
    return row
