"""``dspark-serve eval``: offline drafter evaluation, the paper's Table 1 setting (chained
drafting, fixed gamma, full verification, scheduler off) on MT-Bench, HumanEval and AlpacaEval.

Per benchmark: tau per round (bonus included), position-wise conditional acceptance, and for a
drafter with a confidence head a static-threshold sweep and ECE/AUROC/Brier of the prefix
survival before and after STS (the calibration beside the drafter, or ``--calibration``);
then the macro average tau. ``--json`` prints one JSON object instead of tables; ``--plots DIR``
writes a reliability diagram per benchmark.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from dspark_serve.drafter.config import DRAFTER_KINDS

BENCHMARKS = {"mtbench": "MT-Bench", "humaneval": "HumanEval", "alpaca": "AlpacaEval"}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="offline accepted length / acceptance / calibration",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="target HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None,
                   help="drafter folder (default: the shipped one of --kind)")
    p.add_argument("--kind", choices=(*DRAFTER_KINDS, "ngram", "hybrid"), default="dspark",
                   help="ngram / hybrid run through the engine (static scheduler: every draft "
                        "verified), reporting tau and conditional acceptance")
    p.add_argument("--engine", action="store_true",
                   help="evaluate dspark / dflash through the engine too (comparable with "
                        "ngram / hybrid; no calibration metrics)")
    p.add_argument("--corpus", default=None,
                   help="hybrid: corpus-lookup folder or 'shipped' (as serve --corpus; "
                        "default: off)")
    p.add_argument("--lookup-min-match", type=int, default=None,
                   help="hybrid: shortest suffix match prompt lookup drafts a row with (as "
                        "serve --lookup-min-match; default: as served)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (greedy) or e.g. 1")
    p.add_argument("--gamma", type=int, default=None, help="block size (default: the drafter's)")
    p.add_argument("--benchmarks", default=",".join(BENCHMARKS),
                   help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    p.add_argument("--limit", type=int, default=40, help="prompts per benchmark (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--calibration", default=None,
                   help="STS JSON (default: sts_calibration.json beside the drafter, if any)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="the drafter's draft vocabulary as `serve --draft-vocab-size` prunes it "
                        "(default: as served)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plots", default=None, help="folder for reliability diagram PNGs")
    p.set_defaults(func=run)


def evaluate(pair, benchmarks: list[str], *, temperature: float, gamma: int | None, limit: int,
             max_new_tokens: int, batch_size: int, temperatures, seed: int = 0,
             plots: str | None = None, progress: bool = False) -> dict:
    """The report dict of ``dspark-serve eval`` (see the module docstring) for a loaded pair.
    temperatures: STS [gamma] tensor or None."""
    from dspark_serve.data.prompt_sets import load_prompts
    from dspark_serve.eval.loading import chat_prompts
    from dspark_serve.eval.metrics import (accepted_length, calibration_metrics,
                                           conditional_acceptance, threshold_sweep)
    from dspark_serve.eval.rounds import run_rounds

    has_conf = pair.drafter.confidence_head is not None
    report = {"temperature": temperature, "draft": pair.draft_path, "benchmarks": {}}
    for name in benchmarks:
        prompts = chat_prompts(pair.tokenizer, load_prompts(name, limit or None))
        rounds = run_rounds(pair.target, pair.drafter, prompts, gamma=gamma,
                            temperature=temperature, max_new_tokens=max_new_tokens,
                            batch_size=batch_size, eos_ids=pair.eos_ids, seed=seed,
                            progress=progress)
        report["gamma"] = rounds.gamma
        entry = {"prompts": len(prompts), "rounds": int(rounds.num_accepted.numel()),
                 "generated_tokens": rounds.generated,
                 "tau": accepted_length(rounds.num_accepted),
                 "conditional_acceptance": conditional_acceptance(rounds.num_accepted,
                                                                  rounds.gamma)}
        if has_conf and rounds.num_accepted.numel():
            entry["threshold_sweep"] = threshold_sweep(rounds.conf_logits, rounds.num_accepted,
                                                       temperatures)
            entry["calibration"] = calibration_metrics(rounds.conf_logits, rounds.num_accepted,
                                                       temperatures)
            if plots:
                _plot(Path(plots) / f"reliability_{name}_T{temperature:g}.png", rounds,
                      temperatures, BENCHMARKS.get(name, name))
        report["benchmarks"][name] = entry
    taus = [b["tau"] for b in report["benchmarks"].values() if not math.isnan(b["tau"])]
    report["macro_tau"] = sum(taus) / len(taus) if taus else math.nan
    return report


def _plot(path: Path, rounds, temperatures, title: str) -> None:
    import torch

    from dspark_serve.calibration import calibrated_confidence, prefix_survival_labels
    from dspark_serve.calibration.metrics import reliability_diagram

    g = rounds.gamma
    survived, valid = prefix_survival_labels(rounds.num_accepted,
                                             torch.full_like(rounds.num_accepted, g), g)
    z = rounds.conf_logits.double()
    after = (torch.cumprod(calibrated_confidence(z, temperatures.double()), 1)
             if temperatures is not None else None)
    reliability_diagram(path, torch.cumprod(torch.sigmoid(z), 1), survived,
                        survival_after=after, valid=valid, title=title)


def format_report(report: dict) -> str:
    """Human-readable tables of an ``evaluate`` report."""
    lines = [f"draft {report['draft']}  gamma {report.get('gamma')}  "
             f"temperature {report['temperature']:g}",
             f"{'benchmark':<12}{'prompts':>8}{'rounds':>8}{'tau':>7}  conditional acceptance "
             f"k=1..gamma"]
    for name, b in report["benchmarks"].items():
        acc = " ".join(f"{a:.2f}" for a in b["conditional_acceptance"])
        lines.append(f"{BENCHMARKS.get(name, name):<12}{b['prompts']:>8}{b['rounds']:>8}"
                     f"{b['tau']:>7.3f}  {acc}")
    lines.append(f"{'macro':<28}{report['macro_tau']:>7.3f}")
    for name, b in report["benchmarks"].items():
        if "calibration" not in b:
            continue
        cal = b["calibration"]
        sts = cal["sts"]
        lines.append(f"{BENCHMARKS.get(name, name)}: ECE {100 * cal['raw']['mean_ece']:.2f}%"
                     + (f" -> {100 * sts['mean_ece']:.2f}% (STS)" if sts else "")
                     + f", AUROC {cal['raw']['mean_auroc']:.3f}"
                     + f", Brier {cal['raw']['mean_brier']:.4f}"
                     + (f" -> {sts['mean_brier']:.4f}" if sts else ""))
        lines.append("  threshold  acc.rate  tokens/round  verified/round")
        for row in b["threshold_sweep"]:
            lines.append(f"  {row['threshold']:>9.1f}  {row['acceptance_rate']:>8.3f}  "
                         f"{row['tokens_per_round']:>12.3f}  {row['verified_per_round']:>14.3f}")
    return "\n".join(lines)


def _no_nan(obj):
    """NaN -> null, so ``--json`` output is strict JSON."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _no_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_no_nan(v) for v in obj]
    return obj


def evaluate_engine(args: argparse.Namespace, names: list[str]) -> dict:
    """The report of ``--kind ngram|hybrid`` (or any kind): the engine with the static
    scheduler (gamma drafts verified per round, as the paper's Table 1), per benchmark tau
    (tokens per round, bonus included) and conditional acceptance per position."""
    from dspark_serve.data.prompt_sets import load_prompts
    from dspark_serve.engine.config import EngineConfig
    from dspark_serve.engine.llm_engine import LLMEngine
    from dspark_serve.engine.params import SamplingParams
    from dspark_serve.eval.engine_runs import run_prompts
    from dspark_serve.eval.loading import chat_prompts

    engine = LLMEngine(EngineConfig(model=args.model, draft=args.draft, speculative=args.kind,
                                    scheduler="static", gamma=args.gamma, dtype=args.dtype,
                                    max_num_seqs=args.batch_size, seed=args.seed,
                                    draft_vocab_size=args.draft_vocab_size,
                                    corpus=args.corpus,
                                    **({} if args.lookup_min_match is None else
                                       {"lookup_min_match": args.lookup_min_match})))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens)
    report = {"temperature": args.temperature, "draft": args.draft, "gamma": engine.gamma,
              "benchmarks": {}}
    for name in names:
        prompts = chat_prompts(engine.tokenizer, load_prompts(name, args.limit or None))
        steps: list = []
        run_prompts(engine, prompts, params, steps)
        rounds = sum(s.rounds for s in steps)
        accepted = sum(s.accepted_tokens for s in steps)
        verified = [sum(c) for c in zip(*(s.verified_per_position for s in steps if s.rounds))]
        passed = [sum(c) for c in zip(*(s.accepted_per_position for s in steps if s.rounds))]
        # position k is reached when k-1 drafts were accepted (every draft is verified)
        reached = verified[:1] + passed[:-1]
        report["benchmarks"][name] = {
            "prompts": len(prompts), "rounds": rounds,
            "tau": (accepted + rounds) / rounds if rounds else math.nan,
            "conditional_acceptance": [a / r if r else math.nan for a, r in zip(passed, reached)]}
    taus = [b["tau"] for b in report["benchmarks"].values() if not math.isnan(b["tau"])]
    report["macro_tau"] = sum(taus) / len(taus) if taus else math.nan
    return report


def run(args: argparse.Namespace) -> int:
    from dspark_serve.calibration.io import load_sts_calibration
    from dspark_serve.eval.loading import load_pair

    names = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown or not names:
        raise ValueError(f"unknown benchmarks {unknown}; choose from {', '.join(BENCHMARKS)}")
    if args.kind in ("ngram", "hybrid") or args.engine:
        report = {**evaluate_engine(args, names), "kind": args.kind}
        print(json.dumps(_no_nan(report)) if args.json else format_report(report))
        return 0
    pair = load_pair(args.model, args.draft, args.kind, args.dtype, args.draft_vocab_size)
    gamma = args.gamma or pair.drafter.gamma
    cal_path = args.calibration or Path(pair.draft_path) / "sts_calibration.json"
    temperatures = (load_sts_calibration(cal_path).temperatures_for(gamma)
                    if Path(cal_path).is_file() and pair.drafter.confidence_head is not None
                    else None)
    report = evaluate(pair, names, temperature=args.temperature, gamma=gamma, limit=args.limit,
                      max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                      temperatures=temperatures, seed=args.seed, plots=args.plots,
                      progress=not args.json)
    report["kind"] = args.kind
    report["calibration_file"] = str(cal_path) if temperatures is not None else None
    print(json.dumps(_no_nan(report)) if args.json else format_report(report))
    return 0
