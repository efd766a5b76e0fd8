"""``dspark-serve bench serving``: decoding speed of the embedded engine, in process (no HTTP),
for plain decoding vs DSpark (and DFlash) at several concurrencies.

For each mode one engine is built, warmed up with a short request, and then, per concurrency
C, C requests (the first C MT-Bench first turns in the target's chat template, greedy,
``ignore_eos`` so each yields exactly ``--max-tokens`` tokens) are submitted at once and run
to completion. Reported per cell:

- tok/s/user: mean over requests of (tokens - 1) / (last token time - first token time), the
  decode rate one user sees after the first token;
- agg tok/s: output tokens / time of the steps that ran with the whole batch in flight
  (prefill included; the drain at the end excluded; for a closed loop of C users, the steady
  state, see ``run_batch``);
- TTFT: mean time from a request's submission to its first token; tau: mean accepted length (tokens per verify round)
  over the requests that had verify rounds (the async scheduler may skip drafting);
- step ms: mean engine step time.

``--profile`` runs the torch profiler over one decode step of every mode at the largest
concurrency (after the prompts are prefilled) and prints where the time goes: the engine
phases (draft + schedule, target forward, verify, drafter context update) and the top
operators by self CPU time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Generator
from dataclasses import asdict, dataclass

import torch

from dspark_serve.data.prompt_sets import load_prompts
from dspark_serve.engine.config import QUANTIZATIONS, EngineConfig
from dspark_serve.engine.llm_engine import LLMEngine
from dspark_serve.engine.params import SamplingParams
from dspark_serve.scheduling import SCHEDULER_NAMES
from dspark_serve.types import DTYPES

MODES = ("none", "ngram", "dspark", "hybrid", "dflash")
DEFAULT_CONCURRENCY = (1, 4, 16)
# (engine part, method) -> trace label
PHASES = {("runner", "propose"): "draft+schedule", ("sampler", "verify"): "verify"}


@dataclass
class CellResult:
    """One (mode, concurrency) measurement (see the module docstring)."""

    mode: str
    concurrency: int
    output_tokens: int
    wall_s: float
    user_tok_s: float
    agg_tok_s: float
    ttft_s: float
    tau: float
    step_ms: float


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """Token ids of the first ``count`` MT-Bench first turns (cycled if count > 80)."""

    texts = load_prompts("mtbench")
    ids = []
    for i in range(count):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}],
                                             tokenize=False, add_generation_prompt=True)
        ids.append(tokenizer.encode(chat, add_special_tokens=False))
    return ids


def closed_loop(engine, prompts: list[list[int]], max_tokens: int, mode: str,
                concurrency: int | None = None) -> Generator[None, None, CellResult]:
    """Run every prompt with ``concurrency`` (default: all) requests in flight, submitting the
    next prompt as soon as one finishes (a closed loop of C users), and time it. tok/s/user
    averages the requests that ran to ``max_tokens``.

    A closed loop (C below the prompts) measures a server's steady state, where the C requests
    in flight are at every stage of their output: the first C requests are cut to
    max_tokens * (i + 1) / C tokens (i = 0..C-1), so they finish one after another, as in a
    server that has been running, and agg tok/s counts the steps until the last prompt is
    submitted, when the steady state ends and the drain begins. Starting the C requests
    together instead kept plain decoding's requests in lockstep (they finished together and
    prefilled their successors in one step), while speculation spread them out, and counting
    until the first request of the drain finished charged speculation the prefill of requests
    whose tokens fell in the drain: measured at 16 users, prompt lookup's verify steps served
    a token at plain decoding's cost (1.96 vs 1.94 ms) and still read 6 % below it. Without a
    loop (C = the prompts, all submitted at once): the steps that ran the whole batch, or all
    tokens / wall time without such steps.

    A generator that yields after each engine step and returns the ``CellResult``; its clock
    counts only its own work (submitting and stepping), so ``run_lockstep`` can run several
    engines' loops step by step, a host's slow moments landing on all of them alike.

    Raises:
        ValueError: concurrency outside [1, len(prompts)].
    """
    conc = len(prompts) if concurrency is None else concurrency
    if not 1 <= conc <= len(prompts):
        raise ValueError(f"concurrency must be in [1, {len(prompts)}], got {concurrency}")
    loop = conc < len(prompts)
    own, resumed = 0.0, time.perf_counter()     # seconds of this loop's work before `resumed`
    clock = lambda: own + time.perf_counter() - resumed
    submitted, in_flight, cut = {}, set(), set()

    def submit() -> None:
        i = len(submitted)
        rid = f"bench-{i}"
        submitted[rid] = clock()
        in_flight.add(rid)
        tokens = max(1, -(-max_tokens * (i + 1) // conc)) if loop and i < conc else max_tokens
        if tokens < max_tokens:
            cut.add(rid)
        engine.add_request(rid, prompts[i], SamplingParams(temperature=0.0, max_tokens=tokens,
                                                           ignore_eos=True))

    while len(submitted) < conc:
        submit()
    first, last, count, tau = {}, {}, {}, {}
    steps, full_tokens, full_s = 0, 0, 0.0
    while engine.has_unfinished():
        full = len(submitted) < len(prompts) if loop else len(in_flight) == conc
        before = clock()
        outputs = engine.step()
        steps += 1
        now = clock()
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
                full_tokens += len(out.new_token_ids) if full else 0
            tau[out.request_id] = out.stats.accepted_length
            if out.finished:
                in_flight.discard(out.request_id)
        full_s += now - before if full else 0.0
        while len(in_flight) < conc and len(submitted) < len(prompts):
            submit()
        own = clock()
        yield
        resumed = time.perf_counter()
    wall = clock()
    engine.pop_step_stats()
    rates = [(count[r] - 1) / (last[r] - first[r]) for r in count
             if r not in cut and count[r] > 1 and last[r] > first[r]]
    total = sum(count.values())
    return CellResult(mode, conc, total, wall,
                      statistics.mean(rates) if rates else 0.0,
                      full_tokens / full_s if full_s > 0 else total / wall,
                      statistics.mean(first[r] - submitted[r] for r in first),
                      statistics.mean(drafted) if (drafted := [t for t in tau.values() if t])
                      else 0.0, 1000 * wall / steps)


def run_batch(engine, prompts: list[list[int]], max_tokens: int, mode: str,
              concurrency: int | None = None) -> CellResult:
    """``closed_loop`` run alone to completion (same arguments, result and errors)."""
    return run_lockstep({mode: closed_loop(engine, prompts, max_tokens, mode, concurrency)})[mode]


def run_lockstep(loops: dict[str, Generator[None, None, CellResult]]) -> dict[str, CellResult]:
    """Step the ``closed_loop`` generators in turn, one engine step each, until all finish;
    name -> its CellResult."""
    results: dict[str, CellResult] = {}
    while len(results) < len(loops):
        for name, loop in loops.items():
            if name in results:
                continue
            try:
                next(loop)
            except StopIteration as done:
                results[name] = done.value
    return results


@contextlib.contextmanager
def _annotated_phases(engine):
    """Label the engine's phases in profiler traces (instance attributes, removed on exit)."""
    targets = [(getattr(engine, part), name, label) for (part, name), label in PHASES.items()]
    targets.append((engine.target, "forward", "target forward"))
    if engine.speculator is not None:
        targets.append((engine.speculator, "extend", "drafter context"))

    def labelled(fn, label):
        def call(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return call

    for obj, name, label in targets:
        setattr(obj, name, labelled(getattr(obj, name), label))
    try:
        yield
    finally:
        for obj, name, _ in targets:
            delattr(obj, name)


def profile_step(engine, prompts: list[list[int]], rows: int = 15) -> str:
    """Profiler summary of one decode step with every prompt decoding."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"profile-{i}", ids, params)
    while any(r.prefilling for r in engine.running + engine.waiting):
        engine.step()
    engine.step()  # one decode step untimed
    with _annotated_phases(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.step()
        step_ms = 1000 * (time.perf_counter() - start)
    for r in list(engine.running):
        engine.abort_request(r.request_id)
    engine.pop_step_stats()
    events = prof.key_averages()
    labels = set(PHASES.values()) | {"target forward", "drafter context"}
    phases = [e for e in events if e.key in labels]
    lines = [f"one decode step, {len(prompts)} requests: {step_ms:.1f} ms (profiled)"]
    lines += [f"  {e.key:<16} {e.cpu_time_total / 1000:8.1f} ms" for e in
              sorted(phases, key=lambda e: -e.cpu_time_total)]
    ops = [e for e in events if e.key.startswith("aten::")]
    lines.append("  top operators by self CPU time:")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:rows]:
        lines.append(f"    {e.key:<40} {e.self_cpu_time_total / 1000:8.1f} ms  x{e.count}")
    return "\n".join(lines)


def engine_config(mode: str, args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(speculative=mode, scheduler=args.scheduler, gamma=args.gamma,
                        cost_table=args.cost_table, dtype=args.dtype,
                        quantization=args.quantization,
                        max_num_seqs=max(args.concurrency), max_model_len=args.max_model_len)


def run_mode(mode: str, args: argparse.Namespace) -> tuple[list[CellResult], str | None]:
    """All concurrencies of one mode on one engine (and its profile if asked)."""

    engine = LLMEngine(engine_config(mode, args))
    prompts = chat_prompts(engine.tokenizer, max(args.concurrency))
    run_batch(engine, prompts[:1], 4, mode)  # warm-up
    results = [run_batch(engine, prompts[:c], args.max_tokens, mode) for c in args.concurrency]
    profile = profile_step(engine, prompts) if args.profile else None
    return results, profile


def format_table(results: list[CellResult]) -> str:
    head = (f"{'mode':<7} {'conc':>4} {'tok/s/user':>10} {'agg tok/s':>9} {'TTFT s':>7} "
            f"{'tau':>5} {'step ms':>8}")
    rows = [f"{r.mode:<7} {r.concurrency:>4} {r.user_tok_s:>10.1f} {r.agg_tok_s:>9.1f} "
            f"{r.ttft_s:>7.2f} {f'{r.tau:.2f}' if r.mode != 'none' else '-':>5} "
            f"{r.step_ms:>8.1f}" for r in results]
    return "\n".join([head] + rows)


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serving`` under ``dspark-serve bench``."""
    parser = subparsers.add_parser(
        "serving", help="engine tok/s: plain vs DSpark/DFlash by concurrency",
        description="Decode speed of the embedded engine (in process, no HTTP) on MT-Bench "
                    "prompts: tok/s per user and aggregate, per mode and concurrency.")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="speculative modes (default: all)")
    parser.add_argument("--concurrency", type=positive_int, nargs="+",
                        default=list(DEFAULT_CONCURRENCY), help="default: %(default)s")
    parser.add_argument("--max-tokens", type=positive_int, default=64,
                        help="output tokens per request (default: %(default)s)")
    parser.add_argument("--max-model-len", type=positive_int, default=1024,
                        help="engine context limit (default: %(default)s)")
    parser.add_argument("--scheduler", choices=SCHEDULER_NAMES, default="async",
                        help="dspark verify-length scheduler (default: %(default)s)")
    parser.add_argument("--gamma", type=positive_int, help="block size (default: the drafter's)")
    parser.add_argument("--cost-table", help="SPS cost table JSON (default: profile at start)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="weight dtype (default: %(default)s)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                        help="target weights: none (dtype) or int4 (default: %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one decode step per mode at the largest concurrency")
    parser.add_argument("--json", action="store_true", help="print JSON records instead")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run every mode and print the table; returns the exit code (2 on bad configuration)."""
    results, profiles = [], {}
    try:
        for mode in args.modes:
            cells, profile = run_mode(mode, args)
            results += cells
            if profile:
                profiles[mode] = profile
    except (OSError, ValueError) as exc:
        print(f"dspark-serve bench serving: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        records = [{k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(r).items()}
                   for r in results]
        print(json.dumps({"results": records, "profiles": profiles}))
        return 0
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# {args.max_tokens} tokens/request, greedy, {torch.get_num_threads()} torch threads, "
          f"dtype {args.dtype}, quantization {args.quantization}, load average {load}")
    print(format_table(results))
    for mode, profile in profiles.items():
        print(f"\n[{mode}] {profile}")
    return 0
