"""``dspark-serve bench structured``: structured outputs vs free text, plain decoding vs
DSpark (drafts masked to the grammar or verified as drafted), in process.

Per mode one engine is built; per concurrency C, C JSON-schema requests (chat prompts asking
for the JSON of one of a few schemas, ``response_format``-style, stopping where the grammar
ends) and then C free-text requests (MT-Bench first turns) run to completion, greedy or at
``--temperature`` (where masking the drafts changes acceptance: a greedy draft is one token,
kept or dropped either way).
Reported per cell: tok/s/user (decode rate after the first token), aggregate tok/s, tau
(tokens per verify round), grammar ms per step and the share of the step time it takes.

``--masks`` instead measures the grammar backend alone: the mean time to fill one position's
allowed-token mask while replaying a JSON answer token by token, with xgrammar and (when it
is installed) outlines-core, the alternative this project's choice was measured against.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from dspark_serve.assets.default_model import default_model_path
from dspark_serve.bench.serving import positive_int, chat_prompts
from dspark_serve.engine.config import EngineConfig
from dspark_serve.engine.llm_engine import LLMEngine
from dspark_serve.engine.params import SamplingParams
from dspark_serve.scheduling import SCHEDULER_NAMES
from dspark_serve.structured.compiler import GrammarCompiler
from dspark_serve.structured.masking import new_bitmask
from dspark_serve.structured.spec import json_schema_spec

# name -> (speculative, mask_drafts)
MODES = {"none": ("none", True), "dspark": ("dspark", True),
         "dspark-unmasked": ("dspark", False)}
SCHEMAS = [
    ("Invent a person and give their name, age and city as JSON.",
     {"type": "object", "required": ["name", "age", "city"],
      "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                     "city": {"type": "string"}}}),
    ("List three fruits with their colours as JSON.",
     {"type": "object", "required": ["fruits"],
      "properties": {"fruits": {"type": "array", "minItems": 3, "maxItems": 3,
                                "items": {"type": "object", "required": ["name", "colour"],
                                          "properties": {"name": {"type": "string"},
                                                         "colour": {"type": "string"}}}}}}),
    ("Is the Earth flat? Answer as JSON with a verdict and a reason.",
     {"type": "object", "required": ["verdict", "reason"],
      "properties": {"verdict": {"enum": ["yes", "no"]}, "reason": {"type": "string"}}}),
    ("Describe a book (title, author, year, genres) as JSON.",
     {"type": "object", "required": ["title", "author", "year", "genres"],
      "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                     "year": {"type": "integer"},
                     "genres": {"type": "array", "items": {"type": "string"}}}}),
]
ANSWER = json.dumps({"fruits": [{"name": "apple", "colour": "red"},
                                {"name": "banana", "colour": "yellow"},
                                {"name": "plum", "colour": "purple"}]})


@dataclass
class Cell:
    """One (mode, workload, concurrency) measurement (see the module docstring)."""

    mode: str
    workload: str
    concurrency: int
    output_tokens: int
    user_tok_s: float
    agg_tok_s: float
    tau: float
    grammar_ms_per_step: float
    grammar_share: float


def json_requests(tokenizer, count: int, max_tokens: int,
                  temperature: float) -> list[tuple[list[int], SamplingParams]]:
    """``count`` chat requests cycling through SCHEMAS, each constrained to its schema."""
    out = []
    for i in range(count):
        question, schema = SCHEMAS[i % len(SCHEMAS)]
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{question} Schema: {json.dumps(schema)}"}],
            tokenize=False, add_generation_prompt=True)
        out.append((tokenizer.encode(chat, add_special_tokens=False),
                    SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                   structured=json_schema_spec(schema))))
    return out


def run_cell(engine, mode: str, workload: str,
             requests: list[tuple[list[int], SamplingParams]]) -> Cell:
    """Submit every request at once, step to completion, and time it."""
    start = time.perf_counter()
    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"bench-{i}", ids, params)
    first, last, count, tau = {}, {}, {}, {}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
            tau[out.request_id] = out.stats.accepted_length
    wall = time.perf_counter() - start
    steps = engine.pop_step_stats()
    step_s = sum(s.step_seconds for s in steps)
    grammar_s = sum(s.grammar_seconds for s in steps)
    rates = [(count[r] - 1) / (last[r] - first[r]) for r in count
             if count[r] > 1 and last[r] > first[r]]
    total = sum(count.values())
    return Cell(mode, workload, len(requests), total, statistics.mean(rates) if rates else 0.0,
                total / wall, statistics.mean(tau.values()) if tau else 0.0,
                1000 * grammar_s / max(len(steps), 1), grammar_s / step_s if step_s else 0.0)


def run_mode(mode: str, args: argparse.Namespace) -> list[Cell]:

    speculative, mask = MODES[mode]
    engine = LLMEngine(EngineConfig(speculative=speculative, scheduler=args.scheduler,
                                    cost_table=args.cost_table, always_draft=args.always_draft,
                                    mask_drafts=mask, max_num_seqs=max(args.concurrency),
                                    max_model_len=args.max_model_len))
    texts = chat_prompts(engine.tokenizer, max(args.concurrency))
    jsons = json_requests(engine.tokenizer, max(args.concurrency), args.max_tokens,
                          args.temperature)
    text_params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                 ignore_eos=True)
    run_cell(engine, mode, "warm-up", jsons[:1])
    cells = []
    for c in args.concurrency:
        cells.append(run_cell(engine, mode, "json", jsons[:c]))
        cells.append(run_cell(engine, mode, "text", [(ids, text_params) for ids in texts[:c]]))
    return cells


def format_table(cells: list[Cell]) -> str:
    head = (f"{'mode':<16} {'load':<5} {'conc':>4} {'tok/s/user':>10} {'agg tok/s':>9} "
            f"{'tau':>5} {'grammar ms/step':>15} {'share':>6}")
    rows = [f"{c.mode:<16} {c.workload:<5} {c.concurrency:>4} {c.user_tok_s:>10.1f} "
            f"{c.agg_tok_s:>9.1f} {f'{c.tau:.2f}' if c.mode != 'none' else '-':>5} "
            f"{c.grammar_ms_per_step:>15.2f} {100 * c.grammar_share:>5.1f}%" for c in cells]
    return "\n".join([head] + rows)


def mask_costs(repeats: int = 20) -> dict[str, float]:
    """Mean microseconds to fill one position's mask while replaying ANSWER (schema
    SCHEMAS[1]), per backend; outlines-core only when installed."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    vocab = len(tokenizer)
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    spec = json_schema_spec(SCHEMAS[1][1])
    start = time.perf_counter()
    compiler.compile(spec)
    results = {"xgrammar compile ms": 1000 * (time.perf_counter() - start)}
    mask, fills = new_bitmask(1, vocab), []
    for _ in range(repeats):
        state = compiler.new_state(spec)
        for t in ids:
            t0 = time.perf_counter()
            state.fill(mask, 0)
            fills.append(time.perf_counter() - t0)
            assert state.accept(t)
    results["xgrammar mask us/token"] = 1e6 * statistics.mean(fills)
    try:
        results.update(_outlines_core_costs(tokenizer, ids, repeats))
    except ImportError:
        pass
    return results


def _outlines_core_costs(tokenizer, ids: list[int], repeats: int) -> dict[str, float]:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    vocab: dict[bytes, list[int]] = {}
    for text, i in tokenizer.get_vocab().items():
        if i not in tokenizer.all_special_ids and all(c in byte_of for c in text):
            vocab.setdefault(bytes(byte_of[c] for c in text), []).append(i)
    start = time.perf_counter()
    index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMAS[1][1])),
                                outlines_core.Vocabulary(tokenizer.eos_token_id, vocab))
    results = {"outlines-core compile ms": 1000 * (time.perf_counter() - start)}
    mask = torch.zeros((len(tokenizer) + 31) // 32, dtype=torch.int32)
    fills = []
    for _ in range(repeats):
        guide = outlines_core.Guide(index)
        for t in ids:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            fills.append(time.perf_counter() - t0)
            guide.advance(t)
    results["outlines-core mask us/token"] = 1e6 * statistics.mean(fills)
    return results


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``structured`` under ``dspark-serve bench``."""
    parser = subparsers.add_parser(
        "structured", help="JSON-schema vs free-text tok/s and tau, plain vs DSpark",
        description="Structured outputs vs free text in the embedded engine: tok/s, tau and "
                    "grammar mask time per mode and concurrency (or --masks: backend cost).")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="dspark-unmasked verifies drafts as drafted (default: all)")
    parser.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 4],
                        help="default: %(default)s")
    parser.add_argument("--max-tokens", type=positive_int, default=64,
                        help="most output tokens per request (default: %(default)s)")
    parser.add_argument("--max-model-len", type=positive_int, default=1024,
                        help="engine context limit (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every request (default: greedy)")
    parser.add_argument("--scheduler", choices=SCHEDULER_NAMES, default="async",
                        help="dspark verify-length scheduler (default: %(default)s)")
    parser.add_argument("--always-draft", action="store_true",
                        help="draft every step (measures acceptance; default: the scheduler "
                             "decides)")
    parser.add_argument("--cost-table", help="SPS cost table JSON (default: profile at start)")
    parser.add_argument("--masks", action="store_true",
                        help="measure the grammar backend's mask cost per token instead")
    parser.add_argument("--json", action="store_true", help="print JSON records instead")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark and print its table; returns the exit code (2 on bad configuration)."""
    if args.masks:
        costs = mask_costs()
        print(json.dumps(costs) if args.json else
              "\n".join(f"{k:<28} {v:8.1f}" for k, v in costs.items()))
        return 0
    cells = []
    try:
        for mode in args.modes:
            cells += run_mode(mode, args)
    except (OSError, ValueError) as exc:
        print(f"dspark-serve bench structured: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(c) for c in cells]))
        return 0
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# temperature {args.temperature:g}, <= {args.max_tokens} tokens/request, "
          f"scheduler {args.scheduler}"
          f"{' (always draft)' if args.always_draft else ''}, {torch.get_num_threads()} torch "
          f"threads, load average {load}")
    print(format_table(cells))
    return 0
