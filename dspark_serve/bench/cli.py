"""``dspark-serve bench BENCHMARK``: each benchmark module exposes ``add_parser(subparsers)``,
which registers its sub-subcommand and sets ``func`` (namespace -> exit code)."""
from __future__ import annotations

import argparse
import importlib

# benchmark name -> module providing add_parser()
BENCHMARKS = {
    "scheduler": "dspark_serve.bench.scheduler",
    "serving": "dspark_serve.bench.serving",
    "compare": "dspark_serve.bench.compare",
    "kernels": "dspark_serve.bench.kernels",
    "step": "dspark_serve.bench.step_profile",
    "draft": "dspark_serve.bench.draft_profile",
    "structured": "dspark_serve.bench.structured",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bench`` and its benchmarks on the top-level subparsers."""
    parser = subparsers.add_parser("bench", help="micro-benchmarks",
                                   description="Micro-benchmarks of dspark-serve components.")
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    sub.required = True
    for module in BENCHMARKS.values():
        importlib.import_module(module).add_parser(sub)
