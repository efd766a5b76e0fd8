"""``dspark-serve train-cached``: train a drafter on a target feature cache."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from dspark_serve.training.cache_trainer import CacheTrainConfig

_HELP = {
    "cache": "training cache folders (`dspark-serve cache-features`)",
    "out": "output folder (step-N/, train_log.jsonl, eval_log.jsonl, final/); resumes",
    "init_from": "drafter folder with a pruned draft vocabulary (`dspark-serve prune-vocab`): "
                 "shape, vocabulary and (unless --reinit) starting weights",
    "eval_cache": "cache of held-out target-generated text for the acceptance learning curve",
    "model": "target HF folder (default: SmolLM2-135M-Instruct)",
    "reinit": "start from seeded random weights (keep init_from's shape and vocabulary)",
    "mask_token_id": "override the mask token id", "rope_theta": "override the drafter RoPE base",
    "anchor_context": "feed the anchor slot the context state of position p - 1 "
                      "(EAGLE-style; saved in the drafter's config)",
    "tap_norm": "scale each target tap by 1/RMS (measured on the cache; folded into fc on save)",
    "steps": "optimizer steps (upper bound with --time-budget-minutes)",
    "seqs_per_step": "cached sequences per step",
    "anchors_per_seq": "anchors (blocks) per sequence, all candidates when fewer",
    "lr": "peak AdamW learning rate", "warmup_ratio": "share of steps with linear warmup",
    "weight_decay": "AdamW weight decay", "grad_clip": "gradient norm clip", "alpha_ce": "Eq 9 weight of L_ce",
    "alpha_tv": "Eq 9 weight of L_tv", "alpha_conf": "Eq 9 weight of L_conf",
    "loss_decay": "position weights exp(-(k-1)/decay)", "seed": "init, data order and anchors",
    "save_every": "checkpoint every N steps", "log_every": "log every N steps",
    "eval_every": "held-out evaluation every N steps", "eval_seqs": "held-out sequences per eval",
    "keep": "checkpoints kept",
    "time_budget_minutes": "time the first steps, then lower --steps once to fit this wall time",
    "device": "torch device of the drafter and the cached features (cpu, cuda)",
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train-cached", help="train a drafter on a target feature cache",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(CacheTrainConfig):
        flag = "--" + f.name.replace("_", "-")
        required = f.default is MISSING
        if f.name == "cache":
            p.add_argument(flag, nargs="+", required=True, help=_HELP[f.name])
        elif f.type == "bool":
            p.add_argument(flag, action="store_true", help=_HELP[f.name])
        else:
            kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            p.add_argument(flag, type=kind, required=required,
                           default=None if required else f.default, help=_HELP[f.name])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark_serve.training.cache_trainer import train_cached

    torch.set_num_threads(args.threads)
    keep_freed_memory()
    cfg = CacheTrainConfig(**{f.name: getattr(args, f.name) for f in fields(CacheTrainConfig)})
    print(f"dspark-serve train-cached: final drafter in {train_cached(cfg, log_fn=_flush)}")
    return 0


def keep_freed_memory() -> None:
    """Let glibc reuse freed large blocks instead of unmapping them: every step allocates the
    same [A * gamma, N] buffers, and fresh pages from the OS cost page faults (measured: 9.8 ->
    7.7 ms per block on one core). No-op where glibc's ``mallopt`` is missing."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return
    if hasattr(libc, "mallopt"):
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 1 << 34)


def _flush(msg: str) -> None:
    print(msg, flush=True)
