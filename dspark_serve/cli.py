"""``dspark-serve`` command line: one subcommand per job.

Each subcommand lives in its own module, which exposes ``add_parser(subparsers)`` that
registers the subcommand and sets ``func`` (called with the parsed namespace, returns an exit
code). Modules are imported lazily so ``dspark-serve bench`` does not import the server.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

# Before torch is imported: how long idle OpenMP threads spin before sleeping. Sleeping at
# once (OMP_WAIT_POLICY=PASSIVE) doubles a small step's time on an idle 2-core CPU (wake-ups at
# each of the step's hundreds of parallel regions); spinning long makes steps 3x slower when
# another process holds a core. A short spin (libgomp's count, ~tens of microseconds) keeps
# the idle-machine speed. On a busy shared machine, ``--threads 1`` is fastest.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# subcommand -> module providing add_parser()
SUBCOMMANDS = {
    "bench": "dspark_serve.bench.cli",
    "cache-features": "dspark_serve.training.cache_features",
    "calibrate": "dspark_serve.eval.calibrate_cli",
    "corpus": "dspark_serve.training.corpus_cli",
    "eval": "dspark_serve.eval.eval_cli",
    "heldout-accept": "dspark_serve.training.heldout_accept_cli",
    "gen-data": "dspark_serve.training.gen_data_cli",
    "loadtest": "dspark_serve.loadtest.cli",
    "profile": "dspark_serve.profiler.cli",
    "prune-vocab": "dspark_serve.training.prune_vocab_cli",
    "serve": "dspark_serve.server.cli",
    "train": "dspark_serve.training.train_cli",
    "train-cached": "dspark_serve.training.train_cached_cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="dspark-serve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # Only import the module of the requested subcommand (help lists all names).
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, module in SUBCOMMANDS.items():
        if wanted is None or name == wanted:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=f"see dspark-serve {name} --help")
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command == "serve" and getattr(args, "backend", None) == "sglang":
        # SGLang's own flags pass through unchanged; `--` is optional.
        args = parser.parse_args(_move_after_dashdash(argv, unknown))
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args) or 0)


def _move_after_dashdash(argv: list[str], unknown: list[str]) -> list[str]:
    """``argv`` with each unknown flag (and the values after it) moved behind ``--``.

    argparse alone would hand an unknown flag's value to ``serve``'s positional
    ``sglang_args`` and the flag to the leftovers, splitting ``--tp-size 2``.
    """
    flags = {u for u in unknown if u.startswith("-") and not _NUMBER.match(u)}
    end = argv.index("--") if "--" in argv else len(argv)
    kept, moved, i = [], [], 0
    while i < end:
        if argv[i] in flags:
            moved.append(argv[i])
            i += 1
            while i < end and (not argv[i].startswith("-") or _NUMBER.match(argv[i])):
                moved.append(argv[i])
                i += 1
        else:
            kept.append(argv[i])
            i += 1
    return [*kept, "--", *moved, *argv[end + 1:]]


_NUMBER = re.compile(r"^-\d")


if __name__ == "__main__":
    sys.exit(main())
