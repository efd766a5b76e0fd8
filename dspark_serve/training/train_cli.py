"""``dspark-serve train``: train a DSpark drafter (or the DFlash baseline) for a target."""
from __future__ import annotations

import argparse
from dataclasses import fields

from dspark_serve.drafter.config import DRAFTER_KINDS
from dspark_serve.training.trainer import TrainConfig

_HELP = {
    "data": "data folder written by `dspark-serve gen-data`",
    "out": "output folder (checkpoints step-N/, train_log.jsonl, final/); an existing run resumes",
    "kind": "dspark (Markov + confidence heads, Eq 9 losses) or dflash (baseline: CE only)",
    "model": "target HF folder (default: SmolLM2-135M-Instruct)",
    "steps": "optimizer steps",
    "seqs_per_step": "training sequences per step",
    "anchors_per_seq": "random anchors (blocks) per sequence",
    "max_len": "sequences are cut to this many tokens",
    "lr": "peak AdamW learning rate", "warmup_ratio": "share of steps with linear warmup",
    "weight_decay": "AdamW weight decay", "grad_clip": "gradient norm clip",
    "alpha_ce": "Eq 9 weight of L_ce (default 0.1, dflash 1.0)",
    "alpha_tv": "Eq 9 weight of L_tv (default 0.9, dflash 0)",
    "alpha_conf": "Eq 9 weight of L_conf (default 1.0, dflash 0)",
    "loss_decay": "position weights exp(-(k-1)/decay) (default: gamma, as in the paper)",
    "temperature": "warping temperature of p_d, p_t in L_tv and the Eq 8 label",
    "dtype": "target dtype; bfloat16 also runs the drafter under bf16 autocast",
    "seed": "seed of init, data order and anchors",
    "save_every": "checkpoint every N steps", "log_every": "log every N steps",
    "keep": "checkpoints kept",
    "time_budget_minutes": "fit the run into this wall time: time the first steps, then lower "
                           "--steps once (default: run all --steps)",
    "init_from": "drafter folder to start from (e.g. the shipped one, to train it further; fresh "
                 "optimizer and schedule); ignored when --out resumes a run",
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a DSpark/DFlash drafter (paper Section 3.3)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        if f.name in ("data", "out"):
            p.add_argument(flag, required=True, help=_HELP[f.name])
        elif f.name == "kind":
            p.add_argument(flag, choices=DRAFTER_KINDS, default=f.default,
                           help=_HELP[f.name])
        elif f.name == "dtype":
            p.add_argument(flag, choices=("bfloat16", "float32"), default=f.default,
                           help=_HELP[f.name])
        else:
            p.add_argument(flag, type=kind, default=f.default, help=_HELP[f.name])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark_serve.training.trainer import train

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    print(f"dspark-serve train: final drafter in {train(cfg)}")
    return 0
