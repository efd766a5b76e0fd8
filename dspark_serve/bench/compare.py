"""``dspark-serve bench compare``: our engine's speculative configurations side by side with
llama.cpp (plain and prompt-lookup drafting) on the same GGUF weights, threads and prompts.

What a CPU user would otherwise run is llama.cpp (through llama-cpp-python, the optional
``[bench]`` extra). Our configurations run in lockstep, one engine step of each in turn
(``bench.serving.run_lockstep``, each timed by its own steps), so a slow moment of a shared
host lands on all of them alike: cells run one after another read the same configuration up
to 15-20 % apart on this project's 2-core VM. llama.cpp's configurations run after them;
each cell reports the median over rounds. Our engine serves
a cell as C users in a closed loop over ``cell_prompts(C)`` prompts, the next prompt
submitted as soon as a request finishes, its aggregate counted over the loop's steady state
(``bench.serving.run_batch``); llama.cpp's ``Llama`` decodes one
sequence at a time, as its OpenAI server (``python -m llama_cpp.server``) serves requests, so
it runs the same prompts one after another: its aggregate tok/s is its single-stream rate and
tok/s/user counts the decode rate once a request runs (its queueing shows in TTFT).

llama-cpp-python built natively (``-DGGML_NATIVE=ON``, the default) segfaults at the first
eval of the SmolLM2 Q4_1 file on CPUs with AMX (Sapphire Rapids); that build reports AMX in
``llama_print_system_info``, and this benchmark then skips llama.cpp with the rebuild flags
instead of crashing (``LLAMA_CPP_CMAKE_ARGS``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dspark_serve.bench.serving import (DEFAULT_CONCURRENCY, CellResult, chat_prompts,
                                        closed_loop, run_lockstep)
from dspark_serve.engine.config import QUANTIZATIONS, EngineConfig
from dspark_serve.engine.llm_engine import LLMEngine
from dspark_serve.assets.default_model import default_gguf_path

OUR_MODES = ("none", "ngram", "dflash", "dspark", "hybrid")
LLAMA_MODES = ("llama.cpp", "llama.cpp+lookup")
# llama-cpp-python build flags that run on AMX CPUs (AMX off, AVX-512 on).
LLAMA_CPP_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON "
                        "-DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON "
                        "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_INT8=OFF "
                        "-DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF")
# prompts per user of a cell (a closed loop: C in flight, 3 C in all), and at least
# MIN_CELL_PROMPTS: how much prompt lookup finds depends on the prompt, and one user's three
# prompts measured ngram at 0.92x plain decoding where the first ten gave 1.11x (int4, 2026-12-04)
REQUESTS_PER_USER = 3
MIN_CELL_PROMPTS = 10
# prompt-lookup drafts per llama.cpp round (llama-cpp-python's default is 10; ours is 7)
LLAMA_LOOKUP_TOKENS = 7


@dataclass
class Row:
    """A cell's median over rounds with its ratios to our plain decoding at that concurrency
    (user_x, agg_x) and to llama.cpp plain decoding (user_vs_llama; None without it)."""

    cell: CellResult
    user_x: float
    agg_x: float
    user_vs_llama: float | None


def llama_unavailable(cpu_flags: str | None = None) -> str | None:
    """Why llama.cpp cannot be benchmarked here (None: it can): llama-cpp-python missing, or
    a build that uses AMX (segfaults on the default model's Q4_1 file)."""
    try:
        import llama_cpp
    except ImportError:
        return ("llama-cpp-python is not installed: pip install 'dspark-serve[bench]' (on AMX "
                f"CPUs with CMAKE_ARGS=\"{LLAMA_CPP_CMAKE_ARGS}\")")
    info = llama_cpp.llama_print_system_info().decode()
    if cpu_flags is None:
        cpu_flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "amx_tile" in cpu_flags.split() and "AMX_INT8 = 1" in info:
        return ("this llama-cpp-python build uses AMX, which crashes on the default model's "
                f"Q4_1 file: rebuild with CMAKE_ARGS=\"{LLAMA_CPP_CMAKE_ARGS}\" pip install "
                "--force-reinstall --no-cache-dir llama-cpp-python")
    return None


class LlamaRunner:
    """One llama.cpp model (``lookup``: with its prompt-lookup drafting) over the GGUF file."""

    def __init__(self, gguf: str, threads: int, lookup: bool, context: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=LLAMA_LOOKUP_TOKENS) if lookup else None
        self.mode = LLAMA_MODES[lookup]
        self.llama = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads,
                           n_ctx=context, draft_model=draft, verbose=False)
        self.eos = self.llama.token_eos()

    def run_batch(self, prompts: list[list[int]], max_tokens: int, users: int) -> CellResult:
        """The prompts one after another (module docstring) for ``users`` users in a closed
        loop, greedy, EOS banned so each yields ``max_tokens`` tokens like our ``ignore_eos``
        runs. A user submits its next prompt when its last one finishes: request j arrives
        when request j - users finished (the first ``users`` at the start), and its TTFT
        counts from then."""
        start = time.perf_counter()
        rates, ttfts, finished, total = [], [], [], 0
        for j, ids in enumerate(prompts):
            self.llama.reset()
            times = []
            for _ in self.llama.create_completion(ids, max_tokens=max_tokens, temperature=0.0,
                                                  logit_bias={self.eos: -1e9}, stream=True):
                times.append(time.perf_counter())
            ttfts.append(times[0] - (finished[j - users] if j >= users else start))
            finished.append(times[-1])
            total += len(times)
            if len(times) > 1 and times[-1] > times[0]:
                rates.append((len(times) - 1) / (times[-1] - times[0]))
        wall = time.perf_counter() - start
        return CellResult(self.mode, users, total, wall,
                          statistics.mean(rates) if rates else 0.0, total / wall,
                          statistics.mean(ttfts), 0.0, 0.0)


def cell_prompts(users: int) -> int:
    """Prompts one cell of C users serves, every configuration the same ones:
    max(REQUESTS_PER_USER * C, MIN_CELL_PROMPTS)."""
    return max(REQUESTS_PER_USER * users, MIN_CELL_PROMPTS)


def median_cells(cells: list[CellResult]) -> CellResult:
    """Per-field median of one (mode, concurrency) cell over rounds; tau over the rounds that
    verified any draft (0 = none did: a tau of 1 and a 0 are no tau of 0.5)."""
    med = lambda f: statistics.median(getattr(c, f) for c in cells)
    taus = [c.tau for c in cells if c.tau > 0]
    return replace(cells[0], output_tokens=int(med("output_tokens")), wall_s=med("wall_s"),
                   user_tok_s=med("user_tok_s"), agg_tok_s=med("agg_tok_s"),
                   ttft_s=med("ttft_s"), tau=statistics.median(taus) if taus else 0.0,
                   step_ms=med("step_ms"))


def with_ratios(cells: list[CellResult]) -> list[Row]:
    """Ratios of every cell to our ``none`` and to ``llama.cpp`` at its concurrency."""
    base = {(c.mode, c.concurrency): c for c in cells}
    rows = []
    for c in cells:
        plain, llama = base.get(("none", c.concurrency)), base.get(("llama.cpp", c.concurrency))
        ratio = lambda a, b: a / b if b else float("nan")
        rows.append(Row(c, ratio(c.user_tok_s, plain.user_tok_s) if plain else float("nan"),
                        ratio(c.agg_tok_s, plain.agg_tok_s) if plain else float("nan"),
                        ratio(c.user_tok_s, llama.user_tok_s) if llama else None))
    return rows


def format_rows(rows: list[Row]) -> str:
    head = (f"{'config':<17} {'conc':>4} {'tok/s/user':>10} {'agg tok/s':>9} {'TTFT s':>7} "
            f"{'tau':>5} {'user x none':>11} {'agg x none':>10} {'user x llama':>12}")
    out = [head]
    for r in sorted(rows, key=lambda r: (r.cell.concurrency, _order(r.cell.mode))):
        c = r.cell
        tau = f"{c.tau:.2f}" if c.mode not in ("none",) + LLAMA_MODES else "-"
        vs = f"{r.user_vs_llama:.2f}" if r.user_vs_llama is not None else "-"
        out.append(f"{c.mode:<17} {c.concurrency:>4} {c.user_tok_s:>10.1f} {c.agg_tok_s:>9.1f} "
                   f"{c.ttft_s:>7.2f} {tau:>5} {r.user_x:>11.2f} {r.agg_x:>10.2f} {vs:>12}")
    return "\n".join(out)


def _order(mode: str) -> int:
    return (OUR_MODES + LLAMA_MODES).index(mode)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``compare`` under ``dspark-serve bench``."""
    p = subparsers.add_parser(
        "compare", help="our configurations vs llama.cpp, interleaved, same weights/threads",
        description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", choices=OUR_MODES + LLAMA_MODES,
                   default=list(OUR_MODES + LLAMA_MODES), help="default: all")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY))
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads of both engines (pin the process with taskset)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="int4",
                   help="our target weights (int4 = the GGUF's own Q4_1 grid)")
    p.add_argument("--cost-table", help="SPS cost table JSON (default: profile at start)")
    p.add_argument("--draft", help="drafter folder for dspark/hybrid (default: shipped)")
    p.set_defaults(func=main)


def _our_engines(modes: list[str], args: argparse.Namespace, max_num_seqs: int
                 ) -> dict[str, LLMEngine]:
    """One engine per configuration, all on one copy of the target's weights and one SPS cost
    table (the first profiled, unless ``--cost-table``): separate copies ran ~10 % apart in
    identical engines (where their pages landed), as much as the effects measured, and
    separate startup profiles would schedule each configuration by its own noise."""
    engines: dict[str, LLMEngine] = {}
    weights, cost_table = None, args.cost_table
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            engine = LLMEngine(EngineConfig(
                speculative=mode, draft=args.draft if mode in ("dspark", "hybrid") else None,
                quantization=args.quantization, cost_table=cost_table,
                max_num_seqs=max_num_seqs, max_model_len=1024), target_weights=weights)
            weights = engine.target.weights
            table = getattr(getattr(engine.speculator, "scheduler", None), "cost_table", None)
            if cost_table is None and table is not None:
                cost_table = os.path.join(tmp, "cost_table.json")
                table.save(cost_table)
            engines[mode] = engine
    return engines


def main(args: argparse.Namespace) -> int:
    """Run the interleaved rounds and print the table."""
    torch.set_num_threads(args.threads)
    conc = sorted(args.concurrency)
    runners = _our_engines([m for m in args.configs if m in OUR_MODES], args, max(conc))
    prompts = chat_prompts(next(iter(runners.values())).tokenizer,
                           cell_prompts(max(conc)))
    llama_modes = [m for m in args.configs if m in LLAMA_MODES]
    reason = llama_unavailable() if llama_modes else None
    if reason:
        print(f"# llama.cpp skipped: {reason}", file=sys.stderr)
    else:
        for mode in llama_modes:
            runners[mode] = LlamaRunner(default_gguf_path(), args.threads, mode != "llama.cpp",
                                        context=2048)

    def run(names: list[str], users: int, max_tokens: int) -> dict[str, CellResult]:
        """One cell per configuration: ours in lockstep, then llama.cpp's one by one."""
        cell = prompts[:cell_prompts(users)]
        ours = run_lockstep({n: closed_loop(runners[n], cell, max_tokens, n, users)
                             for n in names if n in OUR_MODES})
        return ours | {n: runners[n].run_batch(cell, max_tokens, users)
                       for n in names if n not in OUR_MODES}

    run(list(runners), 1, 4)   # warm-up
    cells: dict[tuple[str, int], list[CellResult]] = {}
    names = list(runners)
    for rnd in range(args.rounds):
        for c in conc:
            for name, cell in run(names[rnd % len(names):] + names[:rnd % len(names)], c,
                                  args.max_tokens).items():
                cells.setdefault((name, c), []).append(cell)
                print(f"# round {rnd + 1} {name} c={c}: {cell.user_tok_s:.1f} tok/s/user, "
                      f"{cell.agg_tok_s:.1f} aggregate", file=sys.stderr, flush=True)
    rows = with_ratios([median_cells(v) for v in cells.values()])
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# {args.max_tokens} tokens/request, greedy, MT-Bench prompts, {args.threads} "
          f"thread(s) each, ours {args.quantization} in lockstep, median of {args.rounds} "
          f"rounds, load average {load}")
    print(format_rows(rows))
    return 0
