"""``dspark-serve heldout-accept``: exact T = 0 acceptance of drafters on held-out cached
target text (``training.heldout_accept``), the model-selection metric of issue 15."""
from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> None:
    q = subparsers.add_parser("heldout-accept", help="T = 0 acceptance of drafters on held-out "
                              "cached target text (exact, position-wise)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    q.add_argument("--cache", required=True, help="held-out cache folder")
    q.add_argument("--draft", nargs="+", required=True, help="drafter folders")
    q.add_argument("--max-seqs", type=int, default=None, help="sequences (default: all)")
    q.add_argument("--model", default=None, help="target HF folder")
    q.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    q.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft vocabulary as `serve --draft-vocab-size` prunes it (default: "
                        "as served)")
    q.set_defaults(func=run_accept)


def run_accept(args: argparse.Namespace) -> int:
    import torch

    from dspark_serve.assets.default_drafter import draft_vocab_ids
    from dspark_serve.drafter.checkpoint import load_drafter, read_config
    from dspark_serve.model.target_model import TargetModel
    from dspark_serve.assets.default_model import default_model_path
    from dspark_serve.training.feature_cache import FeatureCache
    from dspark_serve.training.heldout_accept import heldout_acceptance
    from dspark_serve.training.train_cached_cli import keep_freed_memory

    torch.set_num_threads(args.threads)
    keep_freed_memory()
    target = TargetModel.from_pretrained(args.model or default_model_path(), dtype="bfloat16")
    cache = FeatureCache(args.cache)
    for folder in args.draft:
        # bf16 weights and the draft vocabulary the engine serves
        vocab = draft_vocab_ids(folder, read_config(folder), args.draft_vocab_size)
        drafter = load_drafter(folder, target.embed_tokens, target.lm_head, dtype=torch.bfloat16,
                               draft_vocab=vocab)
        res = heldout_acceptance(drafter, cache, max_seqs=args.max_seqs, autocast=False)
        print(json.dumps({"draft": folder, **res}), flush=True)
    return 0
