"""Train the default DSpark drafter on a lent GPU in one command (issue 15; driven by
``run.sh``). On a 2-core CPU the target's features cost ~15 CPU-hours per 3M tokens; on one
GPU every tokenized ShareGPT train answer is prefilled in minutes and held in GPU memory
(6.9 KB per token: 37 GB for 5.3M tokens), then ``train_cached`` runs on the same device
until ``--deadline``. Nothing touches a disk cache, so nothing but the drafter has to come back.

Inputs: the target's HF folder (``gguf_to_hf.py``; ``--random-target`` builds a random one of
the same shape for a smoke test), ``--data`` (``tokenize_sharegpt.py``'s npz: the train
prompts of ``data/split`` in the chat template, prompt + answer cut to 768 tokens), the
committed held-out greedy answers, and a pruned warm-start drafter (``prune-vocab``).
Writes to ``--export``: ``results.json`` (held-out T = 0 acceptance of the warm start and
the result on all held-out sequences, bf16 weights as served; throughputs), the trained
drafter (``model.safetensors`` split into 15 MiB parts, ``config.json``) and the run's logs.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from dspark_serve.drafter.checkpoint import load_drafter
from dspark_serve.model.target_model import TargetModel
from dspark_serve.training.cache_trainer import CacheTrainConfig, train_cached
from dspark_serve.training.feature_cache import CachedSequence, target_token_features
from dspark_serve.training.feature_sources import generated_sequences
from dspark_serve.training.heldout_accept import heldout_acceptance

_PART = 15 << 20


def npz_sequences(path: str, limit: int | None):
    """(key, ids [T] int64, loss_mask [T] bool) from the tokenized npz, in its order."""
    z = np.load(path)
    ids, lengths, prompts, index = z["ids"], z["lengths"], z["prompt_lens"], z["index"]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(len(lengths) if limit is None else min(limit, len(lengths))):
        x = torch.from_numpy(ids[starts[i]:starts[i + 1]].astype(np.int64))
        mask = torch.zeros(len(x), dtype=torch.bool)
        mask[int(prompts[i]):] = True
        yield f"sharegpt:{int(index[i])}", x, mask


def prefill(target, items, *, batch_tokens: int, stop_at: float) -> tuple[list, int, float]:
    """Features of ``items`` as ``CachedSequence`` on the target's device, until ``stop_at``
    (time.time()); returns (sequences, tokens, seconds)."""
    out, batch, tokens, t0 = [], [], 0, time.time()

    def run() -> None:
        feats = target_token_features(target, [x for _, x, _ in batch])
        for (key, x, m), (taps, final, lse, greedy) in zip(batch, feats):
            out.append(CachedSequence(key, x.to(target.device), m.to(target.device),
                                      taps, final, lse, greedy))
        batch.clear()

    for item in items:
        batch.append(item)
        tokens += item[1].numel()
        if sum(x.numel() for _, x, _ in batch) >= batch_tokens:
            run()
            if time.time() > stop_at:
                break
    if batch:
        run()
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return out, sum(s.ids.numel() for s in out), time.time() - t0


def served_acceptance(folder, target, heldout) -> dict:
    """Held-out acceptance with bf16 weights, as ``dspark-serve heldout-accept`` measures."""
    drafter = load_drafter(folder, target.embed_tokens, target.lm_head, dtype=torch.bfloat16,
                           device=target.device)
    return heldout_acceptance(drafter, heldout, autocast=False)


def export(final: Path, dest: Path) -> list[str]:
    """Copy the drafter folder into ``dest`` with model.safetensors cut into 15 MiB parts
    (the device returns files of at most 16 MiB); returns the names written."""
    names = []
    for f in sorted(final.iterdir()):
        if f.name == "model.safetensors":
            data = f.read_bytes()
            for i in range(0, len(data), _PART):
                name = f"model.safetensors.{i // _PART:02d}"
                (dest / name).write_bytes(data[i:i + _PART])
                names.append(name)
        elif f.suffix == ".json":
            shutil.copy(f, dest / f.name)
            names.append(f.name)
    return names


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target HF folder")
    p.add_argument("--random-target", help="config folder: random weights of that shape (smoke)")
    p.add_argument("--data", required=True)
    p.add_argument("--heldout", default="results/heldout-greedy")
    p.add_argument("--init", required=True, help="pruned warm-start drafter folder")
    p.add_argument("--work", required=True)
    p.add_argument("--export", required=True)
    p.add_argument("--deadline", type=float, required=True, help="time.time() to be done by")
    p.add_argument("--feature-seconds", type=float, default=150.0)
    p.add_argument("--max-seqs", type=int, default=None)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seqs-per-step", type=int, default=8)
    p.add_argument("--anchors-per-seq", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=300)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the same code here")
    args = p.parse_args()
    began = time.time()
    dest = Path(args.export)
    dest.mkdir(parents=True, exist_ok=True)
    dev = args.device
    results = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else dev}

    def log(msg: str) -> None:
        print(f"[{time.time() - began:6.1f} s] {msg}", flush=True)

    def save_results() -> None:
        (dest / "results.json").write_text(json.dumps(results, indent=1))

    init_cfg = json.loads((Path(args.init) / "config.json").read_text())
    taps = list(init_cfg["target_layer_ids"]) + [init_cfg["num_target_layers"] - 1]
    if args.random_target:
        from transformers import AutoConfig, AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.random_target))
        target = TargetModel.from_hf(hf.float().eval(), device=dev, target_layer_ids=taps)
    else:
        target = TargetModel.from_pretrained(args.target, dtype="float32", device=dev,
                                             target_layer_ids=taps)
    log(f"target on {results['device']}")

    heldout, n_ho, s_ho = prefill(target, generated_sequences(args.heldout, max_len=768),
                                  batch_tokens=args.batch_tokens, stop_at=float("inf"))
    log(f"held-out: {len(heldout)} sequences, {n_ho} tokens in {s_ho:.1f} s")
    train, n_tr, s_tr = prefill(target, npz_sequences(args.data, args.max_seqs),
                                batch_tokens=args.batch_tokens,
                                stop_at=time.time() + args.feature_seconds)
    results.update(train_sequences=len(train), train_tokens=n_tr,
                   train_anchors=sum(int(s.loss_mask.sum()) for s in train),
                   prefill_tokens_per_s=n_tr / s_tr,
                   gpu_memory_gb=torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else 0)
    log(f"train: {len(train)} sequences, {n_tr} tokens in {s_tr:.1f} s "
        f"({n_tr / s_tr:.0f} tok/s), GPU memory {results['gpu_memory_gb']:.1f} GB")
    results["init"] = served_acceptance(args.init, target, heldout)
    log(f"warm start, held-out: pos1 {results['init']['pos1']:.4f} "
        f"tau {results['init']['tau']:.3f}")
    save_results()

    # leave ~40 s for the final evaluation and the export
    budget = (args.deadline - time.time() - 40) / 60
    cfg = CacheTrainConfig(
        cache=["gpu:sharegpt-train"], out=str(Path(args.work) / "run"), init_from=args.init,
        device=dev, lr=args.lr, warmup_ratio=0.03, loss_decay=4.0,
        seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq, steps=1_000_000,
        time_budget_minutes=budget, save_every=1_000_000, log_every=25,
        eval_every=args.eval_every, eval_seqs=40, seed=args.seed, keep=1)
    results["train_config"] = dict(vars(cfg))
    t0 = time.time()
    final = train_cached(cfg, target=target, caches=[train], eval_sequences=heldout, log_fn=log)
    results["train_seconds"] = time.time() - t0
    results["final"] = served_acceptance(final, target, heldout)
    log(f"trained, held-out: pos1 {results['final']['pos1']:.4f} "
        f"tau {results['final']['tau']:.3f}")
    results["files"] = export(final, dest)
    for name in ("train_log.jsonl", "eval_log.jsonl"):
        shutil.copy(Path(cfg.out) / name, dest / name)
    save_results()
    log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
