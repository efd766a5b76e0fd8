"""Sweep: for each server configuration and each concurrency level, a fresh server on a free
loopback port, a warm-up, a bounded headless Locust run, and a summary row; results go to
``summary.csv`` / ``summary.json`` / ``requests.csv`` under the output folder (rewritten after
every run, so an interrupted sweep keeps what it measured) plus one folder per run with the
server and Locust logs, the raw records and Locust's CSV statistics.

A total time budget bounds the whole sweep: each run gets an equal share of what is left; the
largest server start + warm-up + stop time seen so far comes off it, and the rest is split into
the measured run (two thirds, at most ``run_time_s``) and a tail in which requests still in
flight may finish (Locust's ``--stop-timeout``, at most ``MAX_TAIL_S``; it ends as soon as they
have). Runs that no longer fit are recorded as skipped, so ``python -m dspark_serve.loadtest sweep`` finishes
in the stated time on any machine.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dspark_serve.assets import default_model
from dspark_serve.loadtest.records import RequestRecord, read_records
from dspark_serve.loadtest.server import DEFAULT_SERVER_CMD, ManagedServer, ServerError
from dspark_serve.loadtest.summary import SUMMARY_FIELDS, failed_row, summarize

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
# name -> dspark-serve serve flags
CONFIGS = {
    "none": ["--speculative", "none"],
    "ngram": ["--speculative", "ngram"],
    "hybrid": ["--speculative", "hybrid"],
    "dflash": ["--speculative", "dflash"],
    "dspark": ["--speculative", "dspark", "--scheduler", "async"],
    "dspark-algorithm1": ["--speculative", "dspark", "--scheduler", "algorithm1"],
    "dspark-static": ["--speculative", "dspark", "--scheduler", "static"],
    "dspark-threshold": ["--speculative", "dspark", "--scheduler", "threshold"],
}
# name -> llama-cpp-python OpenAI server flags (the CPU peer on the same GGUF weights and as
# many threads as ``serve`` uses by default: one core left to the HTTP event loop)
LLAMA_CONFIGS = {
    "llama.cpp": [],
    "llama.cpp-lookup": ["--draft_model", "prompt-lookup-decoding",
                         "--draft_model_num_pred_tokens", "7"],
}
LLAMA_SERVER_CMD = (sys.executable, "-m", "llama_cpp.server")
ALL_CONFIGS = tuple(CONFIGS) + tuple(LLAMA_CONFIGS)
OVERHEAD_GUESS_S = 20.0  # server start + warm-up + stop, until one run has been measured
LOCUST_START_S = 3.0  # Locust's own start (imports, prompt sets) before its run-time counts
MIN_RUN_S = 3
RUN_SHARE = 2 / 3  # of a run's Locust time; the rest is the tail
MAX_TAIL_S = 30
PLOT_RESERVE_S = 10.0
WARMUP_REQUESTS = 2  # concurrent, so a batched step is exercised too
RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))


@dataclass
class SweepOptions:
    """Everything one sweep needs (``python -m dspark_serve.loadtest sweep --help`` documents each)."""

    out_dir: Path
    configs: list[str] = field(default_factory=lambda: ["none", "dflash", "dspark"])
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    run_time_s: int = 40
    time_budget_s: float = 900.0
    max_requests: int = 0
    prompt_sets: str = "mtbench,humaneval,sharegpt"
    max_tokens: int = 64
    min_tokens: int = 16
    max_prompt_chars: int = 1200
    think_time_s: float = 0.5
    temperature: float = 0.0
    seed: int = 0
    server_cmd: list[str] = field(default_factory=lambda: list(DEFAULT_SERVER_CMD))
    server_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        unknown = [c for c in self.configs if c not in ALL_CONFIGS]
        if unknown or not self.configs:
            raise ValueError(f"unknown or no configs {unknown}; choose from {', '.join(CONFIGS)}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.run_time_s < MIN_RUN_S or self.time_budget_s <= 0:
            raise ValueError(f"need run_time_s >= {MIN_RUN_S} and a positive time budget")
        self.out_dir = Path(self.out_dir)


def locust_command(opts: SweepOptions, url: str, users: int, run_time_s: int,
                   run_dir: Path, tail_s: int = 0) -> list[str]:
    """The headless Locust command line of one run (``tail_s``: its --stop-timeout)."""
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "-u", str(users), "-r", str(max(users, 100)), "-t", f"{run_time_s}s", "-H", url,
            "--stop-timeout", str(tail_s),
            "--only-summary", "--csv", str(run_dir / "locust"),
            "--records-file", str(run_dir / "requests.jsonl"),
            "--window-file", str(run_dir / "window.json"),
            "--max-requests", str(opts.max_requests), "--prompt-sets", opts.prompt_sets,
            "--max-tokens", str(opts.max_tokens), "--min-tokens", str(opts.min_tokens),
            "--max-prompt-chars", str(opts.max_prompt_chars),
            "--think-time", str(opts.think_time_s), "--temperature", str(opts.temperature),
            "--workload-seed", str(opts.seed)]


def run_one(opts: SweepOptions, config: str, users: int, run_time_s: int,
            tail_s: int = 0) -> tuple[dict, list, float]:
    """Start a server, warm it up, run Locust; returns (summary row, request records, seconds
    spent outside Locust: server start, warm-up, stop)."""
    run_dir = opts.out_dir / "runs" / f"{config}-c{users}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("requests.jsonl", "window.json"):
        (run_dir / stale).unlink(missing_ok=True)
    start, locust_s = time.monotonic(), 0.0
    try:
        with _server(opts, config, run_dir / "server.log") as server:
            t0 = time.monotonic()
            warmed = server.warm_up(WARMUP_REQUESTS)
            print(f"  server healthy in {server.startup_s:.0f} s, warm-up {warmed}/"
                  f"{WARMUP_REQUESTS} ok in {time.monotonic() - t0:.0f} s", file=sys.stderr)
            with open(run_dir / "locust.log", "w", encoding="utf-8") as log:
                t0 = time.monotonic()
                locust = subprocess.run(
                    locust_command(opts, server.url, users, run_time_s, run_dir, tail_s),
                    stdout=log, stderr=subprocess.STDOUT,
                    timeout=LOCUST_START_S + run_time_s + tail_s + 120)
                locust_s = time.monotonic() - t0
    except ServerError as exc:
        print(f"  server failed: {str(exc).splitlines()[0]} (see {run_dir}/server.log)",
              file=sys.stderr)
        return failed_row(config, users, "server_failed"), [], time.monotonic() - start
    except subprocess.TimeoutExpired:
        return failed_row(config, users, "locust_timeout"), [], time.monotonic() - start
    overhead = time.monotonic() - start - locust_s
    records = read_records(run_dir / "requests.jsonl")
    try:
        window = json.loads((run_dir / "window.json").read_text(encoding="utf-8"))
        return summarize(records, window, config=config, concurrency=users), records, overhead
    except (FileNotFoundError, ValueError):
        # Locust exits 1 when some requests failed, which still leaves a window
        print(f"  no measurements: Locust exit code {locust.returncode} "
              f"(see {run_dir}/locust.log)", file=sys.stderr)
        return (failed_row(config, users, f"locust_failed_rc{locust.returncode}"), records,
                overhead)


def _server(opts: SweepOptions, config: str, log: Path) -> ManagedServer:
    if config in CONFIGS:
        return ManagedServer([*CONFIGS[config], *opts.server_args], log,
                             server_cmd=opts.server_cmd, startup_timeout_s=opts.startup_timeout_s)

    # --interrupt_requests False: one request at a time, the others queued; by default a new
    # request interrupts the one being generated (measured: 5 of ~45 tokens at two users)
    threads = str(max(1, (os.cpu_count() or 2) - 1))
    return ManagedServer(["--model", default_model.default_gguf_path(), "--model_alias", "default",
                          "--n_threads", threads, "--n_threads_batch", threads,
                          "--n_ctx", "2048", "--interrupt_requests", "False",
                          *LLAMA_CONFIGS[config]], log,
                         server_cmd=LLAMA_SERVER_CMD, startup_timeout_s=opts.startup_timeout_s,
                         subcommand=None, health_path="/v1/models")


def llama_server_unavailable() -> str | None:
    """Why llama.cpp's OpenAI server cannot run here (None: it can): llama-cpp-python missing
    or built with AMX (``bench.compare.llama_unavailable``), or installed without its server
    extra, whose every start would fail."""
    from dspark_serve.bench import compare   # here: it imports torch and the engine (~3 s)

    reason = compare.llama_unavailable()
    if reason is None:
        try:
            import llama_cpp.server.app  # noqa: F401
        except ImportError as err:
            reason = (f"llama-cpp-python's server cannot start ({err}): pip install "
                      "'dspark-serve[bench]' (llama-cpp-python[server])")
    return reason


def write_results(out_dir: Path, rows: list[dict], records: list[dict], meta: dict) -> None:
    """summary.csv, summary.json (rows + sweep metadata) and requests.csv."""
    with open(out_dir / "summary.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / "summary.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1),
                                          encoding="utf-8")
    with open(out_dir / "requests.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=("config", "concurrency", *RECORD_FIELDS))
        writer.writeheader()
        writer.writerows(records)


def run_sweep(opts: SweepOptions) -> list[dict]:
    """Run every (config, concurrency) pair within the time budget; returns the summary rows
    (also written to ``opts.out_dir``). A llama.cpp configuration whose server cannot start
    here (``llama_server_unavailable``) is skipped up front, its rows "skipped_unavailable"."""
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "options": {k: str(v) if isinstance(v, Path) else v
                        for k, v in dataclasses.asdict(opts).items()}}
    rows, all_records, overheads = [], [], []
    missing = {c: llama_server_unavailable() for c in opts.configs if c in LLAMA_CONFIGS}
    for config, reason in missing.items():
        if reason:
            print(f"{config}: skipped, {reason}", file=sys.stderr)
            rows += [failed_row(config, u, "skipped_unavailable") for u in opts.concurrency]
    plan = [(c, u) for c in opts.configs if not missing.get(c) for u in opts.concurrency]
    for i, (config, users) in enumerate(plan):
        left = opts.time_budget_s - PLOT_RESERVE_S - (time.monotonic() - start)
        overhead = max(overheads) if overheads else OVERHEAD_GUESS_S
        allot = left / (len(plan) - i) - overhead - LOCUST_START_S
        run_time = int(min(opts.run_time_s, allot * RUN_SHARE))
        tail = int(max(0, min(MAX_TAIL_S, allot - run_time)))
        if run_time < MIN_RUN_S:
            print(f"[{i + 1}/{len(plan)}] {config} c={users}: skipped (time budget spent)",
                  file=sys.stderr)
            rows.append(failed_row(config, users, "skipped_budget"))
            continue
        print(f"[{i + 1}/{len(plan)}] {config} c={users}: {run_time} s (+ up to {tail} s for "
              "requests in flight)", file=sys.stderr)
        row, records, spent = run_one(opts, config, users, run_time, tail)
        overheads.append(spent)
        rows.append(row)
        all_records += [{"config": config, "concurrency": users, **r} for r in records]
        write_results(opts.out_dir, rows, all_records, meta)
        if row["status"] == "ok":
            print(f"  {row['requests_ok']} ok / {row['requests_failed']} failed, "
                  f"{row['aggregate_tok_s']:.1f} tok/s aggregate, "
                  f"{row['median_tok_s_user'] or 0:.1f} tok/s/user median", file=sys.stderr)
    meta["elapsed_s"] = time.monotonic() - start
    write_results(opts.out_dir, rows, all_records, meta)
    return rows
