"""``dspark-serve cache-features``: build (or resume) a target feature cache.

Sequences from gen-data folders first, then ShareGPT answers, are prefilled by the frozen
target in flat batches of about ``batch_tokens`` tokens; every ``shard_tokens`` tokens a shard
is written atomically (``feature_cache.write_shard``). Rerunning the same command skips
every cached sequence, so the job can be stopped at any time and resumed.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

from dspark_serve.assets.default_drafter import default_drafter_config
from dspark_serve.assets.default_model import MODEL_NAME, default_model_path
from dspark_serve.drafter.checkpoint import read_config
from dspark_serve.model.target_model import TargetModel
from dspark_serve.training.feature_cache import (FeatureCache, shard_paths,
                                                 target_token_features, write_meta, write_shard)
from dspark_serve.training.feature_sources import generated_sequences, sharegpt_sequences


def build_cache(target, items, out: str | Path, *, batch_tokens: int = 2048,
                shard_tokens: int = 65536, max_tokens: int | None = None,
                log=sys.stderr) -> int:
    """Prefill ``items`` ((key, ids, loss_mask) triples) not yet cached into shards of ``out``.

    Args:
        target: ``TargetModel`` with the drafter's taps and its last layer as final tap.
        max_tokens: stop once the cache holds at least this many tokens (None: all items).
    Returns:
        tokens added by this call.
    """
    out = Path(out)
    done = FeatureCache(out).keys
    total = FeatureCache(out).num_tokens
    next_shard = max((i for i, _ in shard_paths(out)), default=-1) + 1
    pending, batch, added, began = [], [], 0, time.perf_counter()

    def run_batch() -> None:
        feats = target_token_features(target, [ids for _, ids, _ in batch])
        pending.extend((k, ids, m, f) for (k, ids, m), f in zip(batch, feats))
        batch.clear()

    for key, ids, mask in items:
        if max_tokens is not None and total + added >= max_tokens:
            break
        if key in done:
            continue
        batch.append((key, ids, mask))
        added += int(ids.numel())
        if sum(int(i.numel()) for _, i, _ in batch) >= batch_tokens:
            run_batch()
        if sum(int(r[1].numel()) for r in pending) >= shard_tokens:
            write_shard(out, next_shard, pending)
            next_shard += 1
            pending.clear()
            rate = added / (time.perf_counter() - began)
            print(f"cache-features: {total + added} tokens cached ({rate:.0f} tok/s)", file=log,
                  flush=True)
    if batch:
        run_batch()
    if pending:
        write_shard(out, next_shard, pending)
    return added


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "cache-features", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="cache the target's taps and final hidden state per token for training")
    p.add_argument("--out", required=True, help="cache folder; an existing one resumes")
    p.add_argument("--model", default=None, help="target HF folder (default: SmolLM2-135M)")
    p.add_argument("--draft-config", default=None,
                   help="drafter folder whose target_layer_ids to tap (default: the default "
                        "drafter shape for the target)")
    p.add_argument("--sequences", nargs="*", default=[],
                   help="gen-data folders whose target-generated responses to cache")
    p.add_argument("--sharegpt-split", default=None,
                   help="folder with split.json: cache ShareGPT answers of its train prompts")
    p.add_argument("--max-len", type=int, default=768, help="sequences are cut to this")
    p.add_argument("--max-prompt-tokens", type=int, default=384,
                   help="ShareGPT prompts longer than this are skipped")
    p.add_argument("--max-tokens", type=int, default=None, help="stop at this many tokens")
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per target prefill")
    p.add_argument("--shard-tokens", type=int, default=65536, help="tokens per shard")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="target dtype")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    hf_cfg = AutoConfig.from_pretrained(path)
    taps = (read_config(args.draft_config) if args.draft_config else
            default_drafter_config(hf_cfg, "dspark", 0)).target_layer_ids
    write_meta(Path(args.out), hidden_size=hf_cfg.hidden_size, target_layer_ids=taps,
               model=Path(args.model).name if args.model else MODEL_NAME)
    target = TargetModel.from_pretrained(
        path, dtype=args.dtype, target_layer_ids=list(taps) + [hf_cfg.num_hidden_layers - 1])
    sources = [generated_sequences(f, max_len=args.max_len) for f in args.sequences]
    if args.sharegpt_split:
        sources.append(sharegpt_sequences(args.sharegpt_split, AutoTokenizer.from_pretrained(path),
                                          max_prompt_tokens=args.max_prompt_tokens,
                                          max_len=args.max_len))
    t0 = time.perf_counter()
    added = build_cache(target, itertools.chain(*sources), args.out,
                        batch_tokens=args.batch_tokens, shard_tokens=args.shard_tokens,
                        max_tokens=args.max_tokens)
    cache = FeatureCache(args.out)
    print(f"dspark-serve cache-features: +{added} tokens in {time.perf_counter() - t0:.0f} s; "
          f"{len(cache)} sequences, {cache.num_tokens} tokens in {args.out}")
    return 0
