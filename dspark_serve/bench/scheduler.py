"""``dspark-serve bench scheduler``: host latency of one scheduler call (confidence [R, gamma]
-> lengths [R]) for every scheduler over a grid of R and gamma.

Each cell is the median of ``--repeats`` timed calls after ``--warmup`` untimed ones, on the
same fixed-seed confidences (the async scheduler's history advances with every call, as in
serving). The default cost table is the measured CPU step time of SmolLM2-135M (HF eager, fp32,
2 threads; /work/shared/notes/environment.md) as steps/s, with a batch-token limit large enough
for the largest cell; ``--cost-table`` benchmarks a profiled SGLang-format table instead.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from dspark_serve.scheduling import SCHEDULER_NAMES, CostTable, make_scheduler

DEFAULT_REQUESTS = (1, 32, 256, 1024)
DEFAULT_GAMMAS = (5, 7, 16)
# SmolLM2-135M forward of B new tokens on this project's 2-core CPU, seconds.
CPU_BATCH_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CPU_STEP_SECONDS = (0.066, 0.109, 0.087, 0.107, 0.125, 0.177, 0.375, 0.603, 0.798)


def cpu_cost_table(max_batch_tokens: int) -> CostTable:
    """The default table: CPU step times above, feasible up to ``max_batch_tokens``."""
    return CostTable.from_step_times(
        list(CPU_BATCH_TOKENS), list(CPU_STEP_SECONDS),
        max_batch_tokens=max(max_batch_tokens, CPU_BATCH_TOKENS[-1]),
        meta={"device": "2-core AMD EPYC CPU", "model": "SmolLM2-135M-Instruct (HF eager, fp32)",
              "date": "2026-11-29"})


def median_latency_us(scheduler, confidence: torch.Tensor, repeats: int, warmup: int) -> float:
    """Median wall time of ``scheduler(confidence)`` in microseconds."""
    for _ in range(warmup):
        scheduler(confidence)
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        scheduler(confidence)
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def run(requests, gammas, schedulers, *, repeats: int, warmup: int,
        cost_table: CostTable | None = None, seed: int = 0) -> list[dict]:
    """One ``{"scheduler", "R", "gamma", "median_us"}`` record per grid cell."""
    table = cost_table or cpu_cost_table(max(requests) * (max(gammas) + 1))
    gen = torch.Generator().manual_seed(seed)
    records = []
    for num_req in requests:
        for gamma in gammas:
            # Mostly confident drafts with a spread (mean c ~ 0.8), so lengths vary.
            confidence = torch.rand(num_req, gamma, generator=gen).pow(0.25)
            for name in schedulers:
                sched = make_scheduler(name, gamma=gamma, cost_table=table)
                records.append({"scheduler": name, "R": num_req, "gamma": gamma,
                                "median_us": round(median_latency_us(sched, confidence,
                                                                     repeats, warmup), 1)})
    return records


def format_table(records: list[dict]) -> str:
    """Rows (R, gamma), one column per scheduler, median microseconds."""
    names = list(dict.fromkeys(r["scheduler"] for r in records))
    cells = {(r["R"], r["gamma"], r["scheduler"]): r["median_us"] for r in records}
    lines = [f"{'R':>5} {'gamma':>5} " + " ".join(f"{n:>11}" for n in names)]
    for num_req, gamma in dict.fromkeys((r["R"], r["gamma"]) for r in records):
        lines.append(f"{num_req:>5} {gamma:>5} "
                     + " ".join(f"{cells[num_req, gamma, n]:>11.1f}" for n in names))
    return "\n".join(lines + ["(median microseconds per scheduler call)"])


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``scheduler`` under ``dspark-serve bench``."""
    parser = subparsers.add_parser(
        "scheduler", help="scheduler latency per call",
        description="Median host latency of one scheduler call, per scheduler, R and gamma.")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead")
    parser.add_argument("--requests", type=_positive, nargs="+", default=DEFAULT_REQUESTS,
                        metavar="R", help="concurrent requests (default: %(default)s)")
    parser.add_argument("--gamma", type=_positive, nargs="+", default=DEFAULT_GAMMAS,
                        help="block sizes (default: %(default)s)")
    parser.add_argument("--schedulers", nargs="+", choices=SCHEDULER_NAMES,
                        default=SCHEDULER_NAMES, help="default: all")
    parser.add_argument("--repeats", type=_positive, default=200,
                        help="timed calls per cell (default: %(default)s)")
    parser.add_argument("--warmup", type=_non_negative, default=20,
                        help="untimed calls first (default: %(default)s)")
    parser.add_argument("--cost-table", help="SGLang SpsCostTable JSON (default: CPU table)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run the grid and print it; returns the exit code (2 for a bad cost table or a grid
    cell the table cannot hold)."""
    try:
        table = CostTable.load(args.cost_table) if args.cost_table else None
        records = run(args.requests, args.gamma, args.schedulers, repeats=args.repeats,
                      warmup=args.warmup, cost_table=table)
    except (OSError, ValueError) as exc:
        print(f"dspark-serve bench scheduler: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(records) if args.json else format_table(records))
    return 0
