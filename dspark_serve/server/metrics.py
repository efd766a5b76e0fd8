"""Prometheus metrics of one server (own registry per app), fed from the engine's per-step
``StepStats`` in the engine thread (prometheus-client metrics are thread-safe)."""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dspark_serve.engine.outputs import StepStats

THROUGHPUT_WINDOW_S = 10.0
VERIFY_BUDGET_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
GRAMMAR_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)


class ServerMetrics:
    """All metrics of one app; ``observe`` is the engine thread's callback, ``render`` the
    /metrics body (Prometheus text format)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.drafted = Counter("dspark_drafted_tokens", "Draft tokens proposed.", registry=r)
        self.accepted = Counter("dspark_accepted_tokens",
                                "Draft tokens accepted by verification (bonus excluded).",
                                registry=r)
        self.rounds = Counter("dspark_verify_rounds", "Verify rounds (one per request per step).",
                              registry=r)
        self.generated = Counter("dspark_generated_tokens", "Tokens committed to outputs.",
                                 registry=r)
        self.pos_accepted = Counter("dspark_position_accepted",
                                    "Verify rounds whose draft at this position was accepted.",
                                    ["position"], registry=r)
        self.pos_verified = Counter("dspark_position_verified",
                                    "Verify rounds whose draft at this position was verified.",
                                    ["position"], registry=r)
        self.verify_budget = Histogram("dspark_verify_tokens_per_step",
                                       "Verify budget B: target positions verified per step.",
                                       buckets=VERIFY_BUDGET_BUCKETS, registry=r)
        self.step_time = Histogram("dspark_step_seconds", "Wall time of one engine step.",
                                   registry=r)
        self.running = Gauge("dspark_num_requests_running", "Requests in the last step.",
                             registry=r)
        self.waiting = Gauge("dspark_num_requests_waiting", "Requests queued after the last step.",
                             registry=r)
        self.kv_free = Gauge("dspark_kv_free_tokens",
                             "KV-cache token positions new requests can still take.", registry=r)
        self.grammar_time = Histogram("dspark_grammar_mask_seconds",
                                      "Grammar mask time of one engine step (steps with "
                                      "structured-output requests only).",
                                      buckets=GRAMMAR_BUCKETS, registry=r)
        # tau of one output format = (accepted + rounds) / rounds of that format
        self.format_rounds = Counter("dspark_format_verify_rounds",
                                     "Verify rounds by the request's output format.",
                                     ["format"], registry=r)
        self.format_drafted = Counter("dspark_format_drafted_tokens",
                                      "Draft tokens proposed, by output format.", ["format"],
                                      registry=r)
        self.format_accepted = Counter("dspark_format_accepted_tokens",
                                       "Draft tokens accepted, by output format (text, json, "
                                       "regex).", ["format"], registry=r)
        self.finished = Counter("dspark_requests_finished", "Finished requests by reason.",
                                ["finish_reason"], registry=r)
        Gauge("dspark_mean_accepted_length",
              "Mean accepted length tau: committed tokens (incl. bonus) per verify round.",
              registry=r).set_function(self.mean_accepted_length)
        Gauge("dspark_generation_tokens_per_second",
              f"Tokens committed per second over the last {THROUGHPUT_WINDOW_S:g} s.",
              registry=r).set_function(self.tokens_per_second)
        self._lock = threading.Lock()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._accepted_total = 0
        self._rounds_total = 0

    def observe(self, steps: list[StepStats], kv_free_tokens: int, idle: bool = False) -> None:
        """Record the steps popped from the engine (none if no step ran) and its load; an idle
        engine has no running or waiting requests, whatever its last step had."""
        now = time.monotonic()
        for s in steps:
            self.drafted.inc(s.drafted_tokens)
            self.accepted.inc(s.accepted_tokens)
            self.rounds.inc(s.rounds)
            self.generated.inc(s.generated_tokens)
            for k, n in enumerate(s.accepted_per_position, start=1):
                self.pos_accepted.labels(position=str(k)).inc(n)
            for k, n in enumerate(s.verified_per_position, start=1):
                self.pos_verified.labels(position=str(k)).inc(n)
            if s.rounds:
                self.verify_budget.observe(s.verify_tokens)
            self.step_time.observe(s.step_seconds)
            if s.grammar_seconds:
                self.grammar_time.observe(s.grammar_seconds)
            for fmt, spec in s.rounds_by_format.items():
                self.format_rounds.labels(format=fmt).inc(spec.verify_rounds)
                self.format_drafted.labels(format=fmt).inc(spec.drafted_tokens)
                self.format_accepted.labels(format=fmt).inc(spec.accepted_tokens)
            self.running.set(s.num_running)
            self.waiting.set(s.num_waiting)
            with self._lock:
                self._accepted_total += s.accepted_tokens
                self._rounds_total += s.rounds
                self._recent.append((now, s.generated_tokens))
        if idle:
            self.running.set(0)
            self.waiting.set(0)
        self.kv_free.set(kv_free_tokens)

    def mean_accepted_length(self) -> float:
        """tau over the server's lifetime; 0 before the first verify round."""
        with self._lock:
            rounds = self._rounds_total
            return (self._accepted_total + rounds) / rounds if rounds else 0.0

    def tokens_per_second(self) -> float:
        with self._lock:
            cutoff = time.monotonic() - THROUGHPUT_WINDOW_S
            while self._recent and self._recent[0][0] < cutoff:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)
