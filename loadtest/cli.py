"""``python -m dspark_serve.loadtest sweep|plot`` (also ``dspark-serve loadtest sweep|plot``).

The documented full sweep (none / dflash / dspark at concurrency 1, 2, 4, 8, 16 against fresh
embedded servers on loopback, at most 15 minutes, CSV + PNGs into out/sweep):

    python -m dspark_serve.loadtest sweep --out out/sweep
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from dspark_serve.loadtest.sweep import ALL_CONFIGS, SweepOptions


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")


def _configs(text: str) -> list[str]:
    names = list(ALL_CONFIGS) if text == "all" else [x for x in text.split(",") if x]
    unknown = [n for n in names if n not in ALL_CONFIGS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown configs {unknown}; choose from "
                                         f"{', '.join(ALL_CONFIGS)} or all")
    return names


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``loadtest`` with ``sweep`` and ``plot`` under it."""
    p = subparsers.add_parser("loadtest", help="live-traffic sweeps and Pareto-frontier plots",
                              description=__doc__.splitlines()[0])
    add_commands(p)
    return p


def add_commands(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="loadtest_command", metavar="COMMAND")
    sub.required = True
    d = SweepOptions(out_dir=Path("out/sweep"))
    s = sub.add_parser("sweep", help="fresh server per configuration x concurrency, headless "
                                     "Locust, summary CSV/JSON and plots")
    s.add_argument("--out", default="out/sweep", help="output folder (default: %(default)s)")
    s.add_argument("--configs", type=_configs, default=d.configs,
                   help=f"comma-separated from {', '.join(ALL_CONFIGS)}, or all "
                        "(default: none,dflash,dspark)")
    s.add_argument("--concurrency", type=_ints, default=d.concurrency,
                   help="comma-separated user counts (default: 1,2,4,8,16)")
    s.add_argument("--run-time", type=int, default=d.run_time_s,
                   help="longest measured run, seconds (default: %(default)s)")
    s.add_argument("--time-budget", type=float, default=d.time_budget_s,
                   help="whole sweep incl. server starts, seconds (default: %(default)s)")
    s.add_argument("--max-requests", type=int, default=d.max_requests,
                   help="request bound per run, 0 = time only (default: %(default)s)")
    s.add_argument("--prompt-sets", default=d.prompt_sets, help="(default: %(default)s)")
    s.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="output token cap (default: %(default)s)")
    s.add_argument("--min-tokens", type=int, default=d.min_tokens,
                   help="output token floor (default: %(default)s)")
    s.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help="drop longer prompts (default: %(default)s)")
    s.add_argument("--think-time", type=float, default=d.think_time_s,
                   help="mean think time, seconds (default: %(default)s)")
    s.add_argument("--temperature", type=float, default=d.temperature,
                   help="(default: %(default)s)")
    s.add_argument("--seed", type=int, default=d.seed, help="workload seed (default: 0)")
    s.add_argument("--server-cmd", default=shlex.join(d.server_cmd),
                   help="command before 'serve' (default: this Python's dspark_serve.cli)")
    s.add_argument("--server-args", default="",
                   help="extra serve flags for every run, e.g. '--dtype bfloat16'")
    s.add_argument("--startup-timeout", type=float, default=d.startup_timeout_s,
                   help="seconds to wait for /health (default: %(default)s)")
    s.add_argument("--sla", type=_floats, default=None,
                   help="SLA anchors in tok/s/user for the Pareto plot (default: automatic)")
    s.set_defaults(func=_sweep)
    q = sub.add_parser("plot", help="pareto.png and load.png from a summary.csv")
    q.add_argument("summary", help="summary.csv written by sweep")
    q.add_argument("--out", default=None, help="output folder (default: next to the CSV)")
    q.add_argument("--sla", type=_floats, default=None,
                   help="SLA anchors in tok/s/user (default: automatic)")
    q.set_defaults(func=_plot)


def _sweep(args: argparse.Namespace) -> int:
    from dspark_serve.loadtest.plot import plot_sweep
    from dspark_serve.loadtest.sweep import run_sweep
    try:
        opts = SweepOptions(
            out_dir=Path(args.out), configs=args.configs, concurrency=args.concurrency,
            run_time_s=args.run_time, time_budget_s=args.time_budget,
            max_requests=args.max_requests, prompt_sets=args.prompt_sets,
            max_tokens=args.max_tokens, min_tokens=args.min_tokens,
            max_prompt_chars=args.max_prompt_chars, think_time_s=args.think_time,
            temperature=args.temperature, seed=args.seed,
            server_cmd=shlex.split(args.server_cmd), server_args=shlex.split(args.server_args),
            startup_timeout_s=args.startup_timeout)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = run_sweep(opts)
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        for path in plot_sweep(opts.out_dir / "summary.csv", sla=args.sla):
            print(path)
    print(opts.out_dir / "summary.csv")
    return 0 if len(ok) == len(rows) else 1


def _plot(args: argparse.Namespace) -> int:
    from dspark_serve.loadtest.plot import plot_sweep
    try:
        paths = plot_sweep(args.summary, args.out, args.sla)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_serve.loadtest",
                                     description=__doc__.splitlines()[0])
    add_commands(parser)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
