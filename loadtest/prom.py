"""Server-side counters around a measured window, read from ``/metrics`` (Prometheus text):
tokens generated, verify rounds, verify tokens (the verify budget B summed over steps),
drafted/accepted tokens. Differences of two scrapes give exact window totals, including
requests still in flight when the window closes."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# window quantity -> Prometheus sample name exported by dspark_serve.server.metrics
SAMPLES = {
    "generated_tokens": "dspark_generated_tokens_total",
    "verify_rounds": "dspark_verify_rounds_total",
    "verify_tokens": "dspark_verify_tokens_per_step_sum",
    "verify_steps": "dspark_verify_tokens_per_step_count",
    "drafted_tokens": "dspark_drafted_tokens_total",
    "accepted_tokens": "dspark_accepted_tokens_total",
}


def parse_samples(text: str) -> dict[str, float]:
    """The ``SAMPLES`` quantities present in a /metrics body (labels summed)."""
    wanted = {v: k for k, v in SAMPLES.items()}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def scrape(base_url: str, timeout: float = 5.0) -> dict[str, float]:
    """``parse_samples`` of ``{base_url}/metrics``; {} if the server has no such endpoint or
    it cannot be read (the load test then falls back to client-side counts)."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout) as resp:
            return parse_samples(resp.read().decode("utf-8"))
    except (OSError, ValueError):
        return {}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before for the quantities both scrapes have."""
    return {k: after[k] - before[k] for k in after if k in before}
