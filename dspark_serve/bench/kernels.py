"""``dspark-serve bench kernels`` / ``python -m dspark_serve.bench.kernels``: the issue-7 GPU
check of the CUDA kernels. Per case: correctness against the PyTorch reference on fresh
random non-zero inputs with poisoned outputs, then the median of CUDA-event timed runs
(after warm-up) of our op, the PyTorch reference and FlashInfer peers when importable,
against the memory-bandwidth floor (bytes that must move / measured device copy
bandwidth). Prints one table; writes ``kernel_bench.json`` under ``$OUT`` when set.
``--dry-run`` checks the inputs and prints the plan without touching a GPU. A full run
takes about 3-5 minutes on an H100/H200 (see csrc/README.md).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time

import torch

from dspark_serve.bench.kernel_cases import (attention_plan, markov_plan, prepare_attention,
                                             prepare_markov)
from dspark_serve.ops import cuda_ops_available

# Timing: warm-up calls, then up to MAX_REPS timed calls or MAX_SECONDS per callable.
WARMUP, MAX_REPS, MAX_SECONDS = 2, 20, 1.5


def environment() -> dict:
    """What the run can use; nothing here needs a GPU."""
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "extension_built": importlib.util.find_spec("dspark_serve._C") is not None,
            "nvcc": shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                             if "CUDA_HOME" in os.environ else None),
            "ninja": shutil.which("ninja"),
            "flashinfer": importlib.util.find_spec("flashinfer") is not None,
            "out_dir": os.environ.get("OUT") or None}


def median_ms(fn) -> float:
    """Median CUDA-event time of fn() in milliseconds."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times, began = [], time.perf_counter()
    while len(times) < MAX_REPS and (len(times) < 3 or time.perf_counter() - began < MAX_SECONDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device copy bandwidth (read + write bytes per second) of a 1 GiB tensor copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def run_case(case, prepare, flashinfer, bandwidth: float) -> dict:
    prepared = prepare(case, flashinfer)
    ok, detail = prepared.check()
    ours = median_ms(prepared.ours)
    record = {"case": case.name, "ok": ok, "check": detail, "ours_ms": ours,
              "reference_ms": median_ms(prepared.reference),
              "floor_ms": prepared.bytes / (bandwidth * 1e9) * 1e3, "peers": {}}
    for name, fn in prepared.peers.items():
        try:
            record["peers"][name] = median_ms(fn)
        except Exception as exc:  # a peer's API differs between versions: report, go on
            record["peers"][name] = f"n/a: {type(exc).__name__}: {exc}"[:120]
    del prepared
    torch.cuda.empty_cache()
    return record


def format_table(records: list[dict]) -> str:
    lines = [f"{'case':<44} {'check':<5} {'ours ms':>9} {'torch ms':>9} {'x torch':>8} "
             f"{'floor ms':>9} {'%floor':>7}  peers (ms)"]
    for r in records:
        peers = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in r["peers"].items())
        lines.append(f"{r['case']:<44} {'ok' if r['ok'] else 'FAIL':<5} {r['ours_ms']:>9.3f} "
                     f"{r['reference_ms']:>9.3f} {r['reference_ms'] / r['ours_ms']:>8.1f} "
                     f"{r['floor_ms']:>9.3f} {100 * r['floor_ms'] / r['ours_ms']:>6.0f}%  {peers}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Exit codes: 0 all checks passed (or dry run with usable inputs), 1 a check failed,
    2 the inputs are unusable (no GPU, extension not built, $OUT not writable)."""
    env = environment()
    plan = [("markov", c) for c in markov_plan(args.quick)] + \
        [("attention", c) for c in attention_plan(args.quick)]
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    print(f"plan: {len(plan)} cases ({sum(k == 'markov' for k, _ in plan)} Markov sampling, "
          f"{sum(k == 'attention' for k, _ in plan)} verify attention); each: check vs reference, "
          f"then timed ours / torch reference / peers")
    for _, case in plan:
        print(f"  {case.name}")
    problems = []
    if env["out_dir"] and not os.access(env["out_dir"], os.W_OK):
        problems.append(f"$OUT={env['out_dir']} is not writable")
    if args.dry_run:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2 if problems else 0
    if not env["cuda_available"]:
        problems.append("no CUDA device")
    elif not cuda_ops_available():
        problems.append("dspark_serve._C is not built (python setup.py build_ext --inplace)")
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2
    flashinfer = None
    if env["flashinfer"]:
        import flashinfer  # noqa: F811 - optional peer
    bandwidth = copy_bandwidth_gbs()
    print(f"device copy bandwidth: {bandwidth:.0f} GB/s")
    records = []
    for kind, case in plan:
        records.append(run_case(case, prepare_markov if kind == "markov" else prepare_attention,
                                flashinfer, bandwidth))
        last = records[-1]
        print(f"  done {case.name}: ours {last['ours_ms']:.3f} ms, {last['check']}", flush=True)
    print(format_table(records))
    if env["out_dir"]:
        path = os.path.join(env["out_dir"], "kernel_bench.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"environment": env, "copy_bandwidth_gbs": bandwidth, "records": records},
                      f, indent=1)
        print(f"wrote {path}")
    return 0 if all(r["ok"] for r in records) else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kernels`` under ``dspark-serve bench``."""
    parser = subparsers.add_parser("kernels", help="CUDA kernel check and benchmark (GPU)",
                                   description=__doc__.split("\n\n")[0])
    _add_arguments(parser)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="check inputs, print the plan, run nothing")
    parser.add_argument("--quick", action="store_true", help="a few small cases (smoke test)")
    parser.set_defaults(func=main)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m dspark_serve.bench.kernels")
    _add_arguments(_parser)
    _args = _parser.parse_args()
    sys.exit(_args.func(_args))
