"""``dspark-serve gen-data``: regenerate ShareGPT responses with the target (resumable)."""
from __future__ import annotations

import argparse
from dataclasses import fields

from dspark_serve.engine.config import QUANTIZATIONS
from dspark_serve.training.gen_data import SUBSETS, GenDataConfig

_HELP = {
    "out": "data folder (split.json, sequences.jsonl); an existing folder resumes",
    "model": "target HF folder (default: SmolLM2-135M-Instruct)",
    "num_prompts": "unique ShareGPT first user turns used (train + held-out)",
    "heldout": "prompts kept out of training for calibration",
    "greedy_fraction": "share of train prompts answered at temperature 0",
    "temperature": "sampling temperature of the other prompts (model card)",
    "top_p": "top-p of the other prompts (model card)",
    "max_prompt_tokens": "longer prompts are skipped",
    "max_new_tokens": "response length cap",
    "max_num_seqs": "requests decoded together by the engine",
    "dtype": "target dtype",
    "quantization": "target weights: as dtype, or int4 decoder layers (the fast CPU path; bfloat16 only)",
    "seed": "split, greedy share and sampling seed",
    "subset": "which prompts of the split to answer: train; heldout (evaluation text; use a "
              "separate --out folder and --greedy-fraction 1); or followups (the later user "
              "turns of the train prompts' conversations, standalone; a separate --out folder)",
    "limit": "answer only the first N prompts of the subset (default: all)",
    "skip": "leave out the first N prompts of the subset (answered in folders no longer "
            "at hand), before sharding",
    "shard": "answer every --num-shards-th prompt from this one (one process and --out folder "
             "per core; train on all folders)",
    "num_shards": "processes the prompts are shared between",
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("gen-data", help="regenerate training responses with the target",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(GenDataConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        if f.name == "out":
            p.add_argument(flag, required=True, help=_HELP[f.name])
        elif f.name == "dtype":
            p.add_argument(flag, choices=("bfloat16", "float32"), default=f.default,
                           help=_HELP[f.name])
        elif f.name == "quantization":
            p.add_argument(flag, choices=QUANTIZATIONS, default=f.default, help=_HELP[f.name])
        elif f.name == "subset":
            p.add_argument(flag, choices=SUBSETS, default=f.default,
                           help=_HELP[f.name])
        elif f.name == "limit":
            p.add_argument(flag, type=int, default=None, help=_HELP[f.name])
        else:
            p.add_argument(flag, type=kind, default=f.default, help=_HELP[f.name])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark_serve.training.gen_data import generate

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = GenDataConfig(**{f.name: getattr(args, f.name) for f in fields(GenDataConfig)})
    n = generate(cfg)
    print(f"dspark-serve gen-data: {n} new sequences in {cfg.out}")
    return 0
