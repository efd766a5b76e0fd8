"""``dspark-serve profile`` / ``python -m dspark_serve.profiler``: SPS(B) of the embedded engine's target
forward on this machine, written as ``{SKU}.json`` (the cost table ``dspark-serve serve
--cost-table`` and SGLang load) and ``{SKU}.png``.

A small CPU grid in under two minutes (one thread also keeps a shared, busy machine from
stalling on thread synchronisation):

    python -m dspark_serve.profiler --max-batch-tokens 32 --per-octave 2 --context-lens 128,512 \
        --warmup 1 --repeats 3 --threads 1
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from dspark_serve.engine.config import QUANTIZATIONS, EngineConfig
from dspark_serve.profiling.sps import batch_grid, profile_sps
from dspark_serve.types import DTYPES

_DEFAULT_REQUESTS = EngineConfig.__dataclass_fields__["max_num_seqs"].default


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target HF folder (default: the default model, "
                                   "SmolLM2-135M-Instruct, converted once and cached)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="weight dtype (default: %(default)s)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="target weights as served with this flag (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=int, default=256,
                   help="largest B probed, and the table's limit (default: %(default)s)")
    p.add_argument("--per-octave", type=int, default=4,
                   help="probes per doubling of B: 4 gives 8, 10, 12, 14, 16, ... "
                        "(default: %(default)s)")
    p.add_argument("--context-lens", type=_ints, default=[256, 1024],
                   help="context lengths profiled (default: 256,1024)")
    p.add_argument("--table-context-len", type=int, default=None,
                   help="context length the table uses (default: the longest profiled)")
    p.add_argument("--requests", type=int, default=_DEFAULT_REQUESTS,
                   help="requests B tokens are spread over, like the engine's "
                        "--max-num-seqs (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per probe (default: 2)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed steps per probe, median kept (default: %(default)s)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="stop growing B after this many seconds (default: none)")
    p.add_argument("--out-dir", default="out/cost_tables",
                   help="folder for {SKU}.json and {SKU}.png (default: %(default)s)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads torch computes with (part of the CPU SKU name; "
                        "default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens and cache")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``profile`` (the ``dspark_serve.cli`` subcommand convention)."""
    p = subparsers.add_parser("profile", help="profile SPS(B) and write this device's cost "
                                              "table", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Load the target, profile, write the files; returns the exit code."""
    from dspark_serve.model.target_model import TargetModel
    from dspark_serve.profiler.device import device_metadata
    from dspark_serve.profiler.report import write_profile
    from dspark_serve.profiling.runner import device_sync, target_step

    if args.max_batch_tokens < 1 or args.requests < 1 or args.repeats < 1 or args.warmup < 0:
        print("error: need --max-batch-tokens, --requests, --repeats >= 1 and --warmup >= 0",
              file=sys.stderr)
        return 2
    table_ctx = args.table_context_len
    if table_ctx is not None and table_ctx not in args.context_lens:
        print(f"error: --table-context-len {table_ctx} is not among --context-lens "
              f"{args.context_lens}", file=sys.stderr)
        return 2
    if args.threads is not None:
        if args.threads < 1:
            print("error: --threads must be >= 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        from dspark_serve.assets.default_model import default_model_path
        path = default_model_path()
    torch.manual_seed(args.seed)
    model = TargetModel.from_pretrained(path, dtype=args.dtype, device=args.device,
                                        quantization=args.quantization)
    max_len = max(args.context_lens) + math.ceil(args.max_batch_tokens / args.requests)
    cache = model.new_kv_cache(num_slots=args.requests, max_len=max_len)
    grid = batch_grid(args.max_batch_tokens, args.per_octave)
    print(f"profiling {len(grid)} batch sizes x {len(args.context_lens)} context lengths "
          f"on {args.device} ({torch.get_num_threads()} threads)", file=sys.stderr)
    with target_step(model, cache, seed=args.seed) as step:
        profile = profile_sps(step, grid, args.context_lens, warmup=args.warmup,
                              repeats=args.repeats, sync=device_sync(args.device),
                              time_budget_s=args.time_budget)
    meta = device_metadata(args.device, model=os.path.basename(os.path.normpath(path)),
                           dtype=args.dtype, quantization=args.quantization,
                           requests=args.requests)
    json_path, png_path = write_profile(profile, args.out_dir, meta=meta, context_len=table_ctx,
                                        max_batch_tokens=args.max_batch_tokens,
                                        plot=not args.no_plot)
    print(json_path)
    if png_path is not None:
        print(png_path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_serve.profiler", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
