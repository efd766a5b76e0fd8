"""Locust file: simulated chat users streaming ``/v1/chat/completions`` (OpenAI API).

Each user draws a prompt from real sets (MT-Bench, HumanEval, ShareGPT; ``--prompt-sets``), asks
for an output length taken from the prompt's reference answer (capped by ``--max-tokens``),
reads the SSE stream, then thinks for an exponential pause (mean ``--think-time`` s).
Per request it records TTFT, TPOT, tokens, tok/s/user and the server's ``dspark`` stats
(``loadtest.records``) to ``--records-file`` (JSONL), and reports to Locust's statistics: the
request (end-to-end time, response length = completion tokens) plus ``METRIC ttft`` and
``METRIC tpot`` entries. With ``--window-file`` it scrapes ``/metrics`` when all users are
running and when the test stops, for exact server-side window totals.

Run (loopback servers only unless ``--allow-remote``):

    locust -f loadtest/locustfile.py --headless -u 8 -r 100 -t 60s -H http://127.0.0.1:8000 \
        --records-file out/requests.jsonl --window-file out/window.json
"""
from __future__ import annotations

import itertools
import json
import logging
import random
import time

import gevent
from locust import HttpUser, events, task
from locust.exception import StopUser

from dspark_serve.loadtest import prom
from dspark_serve.loadtest.records import StreamTracker
from dspark_serve.loadtest.server import is_loopback
from dspark_serve.loadtest.workload import Workload

logger = logging.getLogger("loadtest")
ENDPOINT = "/v1/chat/completions"

# "inflight": request start times by id; "busy": request-seconds finished inside the window
_state = {"environment": None, "workload": None, "records": None, "started": 0, "finished": 0,
          "window": {}, "inflight": {}, "busy": 0.0}
_user_index = itertools.count()


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    g = parser.add_argument_group("dspark-serve load test")
    g.add_argument("--prompt-sets", default="mtbench,humaneval,sharegpt",
                   help="comma-separated prompt sets (mtbench, humaneval, sharegpt, alpaca)")
    g.add_argument("--max-tokens", type=int, default=256, help="cap on output tokens")
    g.add_argument("--min-tokens", type=int, default=16, help="floor on output tokens")
    g.add_argument("--max-prompt-chars", type=int, default=2000,
                   help="drop prompts longer than this many characters")
    g.add_argument("--think-time", type=float, default=1.0,
                   help="mean think time between a user's requests, seconds (exponential)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    g.add_argument("--model", default="default", help="model name sent in requests")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly max_tokens (server extension ignore_eos)")
    g.add_argument("--workload-seed", type=int, default=0,
                   help="seed of the per-user prompt/length/think-time streams")
    g.add_argument("--records-file", default="", help="append per-request records (JSONL)")
    g.add_argument("--window-file", default="",
                   help="write the measured window and /metrics deltas (JSON)")
    g.add_argument("--max-requests", type=int, default=0,
                   help="stop after this many requests (0: only --run-time bounds the run)")
    g.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --host (refused by default)")


@events.init.add_listener
def _on_init(environment, **_kwargs) -> None:
    _state["environment"] = environment


def _abort(environment, message: str, *args) -> None:
    logger.error(message, *args)
    environment.process_exit_code = 2
    gevent.spawn(environment.runner.quit)


@events.test_start.add_listener
def _on_test_start(environment, **_kwargs) -> None:
    opts = environment.parsed_options
    if not opts.allow_remote and not is_loopback(environment.host or ""):
        _abort(environment, "refusing non-loopback host %r (pass --allow-remote to override)",
               environment.host)
        return
    try:
        _state["workload"] = Workload.from_names(
            [s for s in opts.prompt_sets.split(",") if s], max_prompt_chars=opts.max_prompt_chars,
            max_tokens=opts.max_tokens, min_tokens=opts.min_tokens, think_time_s=opts.think_time)
    except (ValueError, RuntimeError) as exc:
        _abort(environment, "cannot build the workload: %s", exc)
        return
    if opts.records_file:
        _state["records"] = open(opts.records_file, "a", encoding="utf-8", buffering=1)


@events.spawning_complete.add_listener
def _on_spawned(**_kwargs) -> None:
    environment = _state["environment"]
    window = _state["window"]
    if environment.parsed_options.window_file and "t_start" not in window:
        window["t_start"] = time.time()  # before the scrape yields to the users' greenlets
        window["metrics_start"] = prom.scrape(environment.host)


@events.test_stopping.add_listener
def _on_stopping(environment, **_kwargs) -> None:
    path = environment.parsed_options.window_file
    window = _state["window"]
    if path and "t_start" in window and "t_end" not in window:
        t0, t1 = window["t_start"], time.time()
        window["t_end"] = t1
        # Little's law over the window, requests still streaming included (computed before
        # the scrape yields to greenlets that could finish them)
        busy = _state["busy"] + sum(t1 - max(t, t0) for t in _state["inflight"].values())
        window["mean_in_flight"] = busy / (t1 - t0)
        window["metrics_end"] = prom.scrape(environment.host)
        window["metrics_delta"] = prom.delta(window["metrics_start"], window["metrics_end"])
        with open(path, "w", encoding="utf-8") as f:
            json.dump(window, f, indent=1)


@events.quitting.add_listener
def _on_quitting(environment, **_kwargs) -> None:
    if _state["records"] is not None:
        _state["records"].close()
        _state["records"] = None


class ChatUser(HttpUser):
    """One chat user: request, read the whole stream, think, repeat."""

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.opts = opts
        self.rng = random.Random(opts.workload_seed * 1_000_003 + next(_user_index))

    def wait_time(self) -> float:
        workload = _state["workload"]
        return workload.think_time(self.rng) if workload is not None else 1.0

    @task
    def chat(self) -> None:
        opts, limit = self.opts, self.opts.max_requests
        if _state["workload"] is None or (limit and _state["started"] >= limit):
            raise StopUser()  # aborted start, or the request bound is reached
        _state["started"] += 1
        item = _state["workload"].sample(self.rng)
        body = {"model": opts.model, "messages": [{"role": "user", "content": item.prompt}],
                "max_tokens": item.max_tokens, "temperature": opts.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if opts.ignore_eos:
            body["ignore_eos"] = True
        tracker = StreamTracker(item.prompt_set, item.max_tokens, time.time())
        key = _state["started"]
        _state["inflight"][key] = tracker.t_start
        with self.client.post(ENDPOINT, json=body, stream=True, catch_response=True,
                              name="chat/completions") as resp:
            error = ""
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(resp.text or '')[:200]}"
            else:
                try:
                    for line in resp.iter_lines():
                        tracker.feed(line, time.time())
                except OSError as exc:  # connection dropped mid-stream
                    error = f"stream broken: {exc}"
            rec = tracker.record(time.time(), error)
            resp.request_meta["response_time"] = (rec.t_end - rec.t_start) * 1000.0
            resp.request_meta["response_length"] = rec.completion_tokens
            if rec.ok:
                resp.success()
            else:
                resp.failure(rec.error)
        del _state["inflight"][key]
        t0 = _state["window"].get("t_start")
        if t0 is not None and "t_end" not in _state["window"]:
            _state["busy"] += rec.t_end - max(rec.t_start, t0)
        if rec.ok and rec.ttft_s is not None:
            self._metric("ttft", rec.ttft_s)
        if rec.ok and rec.tpot_s is not None:
            self._metric("tpot", rec.tpot_s)
        if _state["records"] is not None:
            _state["records"].write(rec.to_json() + "\n")
        _state["finished"] += 1
        if limit and _state["finished"] >= limit:
            gevent.spawn(self.environment.runner.quit)

    def _metric(self, name: str, seconds: float) -> None:
        self.environment.events.request.fire(
            request_type="METRIC", name=name, response_time=seconds * 1000.0,
            response_length=0, exception=None, context={})
