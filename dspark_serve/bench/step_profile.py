"""``dspark-serve bench step``: time of one target forward step versus the number of tokens B
in it, plain greedy decoding speed at batch 1, and a torch profiler summary of one step.

Each step time is the median of ``--repeats`` forwards after warm-up. The B tokens are spread
over B / k requests of k tokens each (``--tokens-per-request``: 1 = decode, gamma + 1 = verify
blocks), every request sitting on ``--context`` cached positions. The cache is filled with
random finite keys/values instead of prefilled (the time does not depend on their values).
The host's load average is printed with the results: on a shared machine OpenMP's barriers
make multi-threaded steps many times slower whenever another process holds a core, so compare
runs at similar load and prefer ``--threads 1`` there.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from dspark_serve.assets.default_model import default_model_path
from dspark_serve.engine.config import QUANTIZATIONS
from dspark_serve.model.kv_cache import KVCache
from dspark_serve.model.target_model import TargetModel
from dspark_serve.types import DTYPES

DEFAULT_BATCH_TOKENS = (1, 2, 4, 8, 16, 32, 64)


def _timed(fn, repeats: int, warmup: int = 2) -> tuple[list[float], list[float]]:
    """Wall and process-CPU seconds of ``repeats`` calls."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def filled_cache(model: TargetModel, num_slots: int, max_len: int, seed: int = 0) -> KVCache:
    """A cache with every slot allocated and holding random keys/values (scale 0.5)."""
    cache = model.new_kv_cache(num_slots, max_len)
    gen = torch.Generator(device=cache.k.device).manual_seed(seed)
    for t in (cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device).mul_(0.5))
    for _ in range(num_slots):
        cache.allocate()
    return cache


def step_inputs(batch_tokens: int, tokens_per_request: int, context: int, vocab_size: int):
    """(input_ids, slots, positions) [B] of one step: request r owns slot r and feeds
    positions context..context+k-1."""
    num_req = -(-batch_tokens // tokens_per_request)
    slots = torch.arange(num_req).repeat_interleave(tokens_per_request)[:batch_tokens]
    positions = context + torch.arange(tokens_per_request).repeat(num_req)[:batch_tokens]
    ids = torch.randint(0, vocab_size, (batch_tokens,), generator=torch.Generator().manual_seed(0))
    return ids, slots, positions


def step_times(model: TargetModel, batch_tokens=DEFAULT_BATCH_TOKENS, *, context: int = 256,
               tokens_per_request: int = 1, repeats: int = 15) -> list[dict]:
    """One record per B: ``{"B", "median_ms", "p10_ms", "p90_ms", "cpu_ms"}`` (wall times;
    median process CPU time, which with one thread approximates the wall time of an idle
    machine) for a forward over B tokens with logits for all of them (as a verify step)."""
    num_req = -(-max(batch_tokens) // tokens_per_request)
    cache = filled_cache(model, num_req, context + tokens_per_request)
    records = []
    for b in batch_tokens:
        ids, slots, positions = step_inputs(b, tokens_per_request, context,
                                            model.weights.vocab_size)
        wall, cpu = _timed(lambda: model.forward(ids, slots, positions, cache), repeats)
        wall.sort()
        records.append({"B": b, "median_ms": 1e3 * statistics.median(wall),
                        "p10_ms": 1e3 * wall[len(wall) // 10],
                        "p90_ms": 1e3 * wall[(9 * len(wall)) // 10],
                        "cpu_ms": 1e3 * statistics.median(cpu)})
    return records


def greedy_tokens_per_s(model: TargetModel, *, prompt_len: int = 256,
                        new_tokens: int = 64) -> float:
    """Plain greedy decoding of one request after a ``prompt_len``-token prefill: generated
    tokens per second (wall clock) of the decode phase (forward + argmax per token, no engine
    around it)."""
    cache = model.new_kv_cache(1, prompt_len + new_tokens)
    slot = torch.tensor([cache.allocate()])
    prompt = torch.randint(0, model.weights.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(0))
    out = model.forward(prompt, slot.expand(prompt_len), torch.arange(prompt_len), cache,
                        torch.tensor([prompt_len - 1]))
    token = out.logits.argmax(-1)
    start = time.perf_counter()
    for pos in range(prompt_len, prompt_len + new_tokens):
        token = model.forward(token, slot, torch.tensor([pos]), cache).logits.argmax(-1)
    return new_tokens / (time.perf_counter() - start)


def profile_step(model: TargetModel, batch_tokens: int, *, context: int = 256,
                 tokens_per_request: int = 1, steps: int = 3, rows: int = 15) -> str:
    """torch profiler table (operators by self CPU time, averaged over ``steps`` forwards)."""
    from torch.profiler import ProfilerActivity, profile

    cache = filled_cache(model, -(-batch_tokens // tokens_per_request),
                         context + tokens_per_request)
    ids, slots, positions = step_inputs(batch_tokens, tokens_per_request, context,
                                        model.weights.vocab_size)
    _timed(lambda: model.forward(ids, slots, positions, cache), repeats=0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            model.forward(ids, slots, positions, cache)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def format_step_table(records: list[dict]) -> str:
    lines = [f"{'B':>5} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'cpu ms':>8} "
             f"{'tokens/s':>9}"]
    for r in records:
        lines.append(f"{r['B']:>5} {r['median_ms']:>10.1f} {r['p10_ms']:>8.1f} "
                     f"{r['p90_ms']:>8.1f} {r['cpu_ms']:>8.1f} "
                     f"{1e3 * r['B'] / r['median_ms']:>9.0f}")
    return "\n".join(lines)


def _load_text() -> str:
    return "load average %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count())


def main(args: argparse.Namespace) -> int:

    torch.set_num_threads(args.threads)
    model = TargetModel.from_pretrained(args.model or default_model_path(), dtype=args.dtype,
                                        quantization=args.quantization)
    print(f"target {args.model or 'default SmolLM2-135M-Instruct'} dtype={args.dtype} "
          f"quantization={args.quantization} "
          f"threads={args.threads} context={args.context} k={args.tokens_per_request}; "
          + _load_text())
    records = step_times(model, args.batch_tokens, context=args.context,
                         tokens_per_request=args.tokens_per_request, repeats=args.repeats)
    print(format_step_table(records))
    print(f"plain greedy decode, batch 1: {greedy_tokens_per_s(model, prompt_len=args.context):.1f}"
          " tokens/s")
    if args.profile_batch:
        print(f"\nprofile of one step with B={args.profile_batch}:")
        print(profile_step(model, args.profile_batch, context=args.context,
                           tokens_per_request=args.tokens_per_request))
    print(_load_text())
    return 0


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected comma-separated positive integers")
    return values


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``step`` on the ``bench`` subparsers."""
    p = subparsers.add_parser("step", help="target forward step time vs batch tokens",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="target weights: none (dtype) or int4")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--batch-tokens", type=_int_list, default=list(DEFAULT_BATCH_TOKENS))
    p.add_argument("--tokens-per-request", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--profile-batch", type=int, default=1, help="0 = no profile")
    p.set_defaults(func=main)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m dspark_serve.bench.step_profile")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    parsed = parser.parse_args()
    raise SystemExit(parsed.func(parsed))
