"""Drafter training on a target feature cache (issue 15; paper Section 3.3): no target forward,
many anchors per sequence sharing one context pass, a pruned draft vocabulary.

Per step: ``seqs_per_step`` cached sequences (consecutive slices of a seeded permutation per
epoch, ``trainer.batch_for_step``), up to ``anchors_per_seq`` anchors each (all candidates when
fewer; drawn by a generator seeded by (seed, step, sequence slot)), one shared-context forward
per sequence (``shared_context``), Eq 8-12 in draft space (``draft_space_loss``) averaged over
the whole step, one AdamW update (betas 0.9/0.95, warmup + cosine, grad clip). Deterministic
given the seed, so a resumed run continues exactly where it stopped.

The drafter starts from ``init_from`` (a DeepSpec folder: its shape and its draft vocabulary
(``dspark-serve prune-vocab``); its weights unless ``reinit``). Options A/B-tested in issue 15:
``tap_norm`` (each tap scaled by 1/RMS measured on the cache, folded into fc on save),
``anchor_context`` (the anchor slot also gets H_ctx[p - 1]; a config field the engine serves),
``mask_token_id`` and ``rope_theta`` overrides, ``loss_decay``.

Output folder: ``step-NNNNNN/`` checkpoints (``checkpointing``), ``train_log.jsonl`` (loss
terms, ms per block), ``eval_log.jsonl`` (held-out T = 0 acceptance, ``heldout_accept``: the
learning curve) and ``final/`` (bf16 DeepSpec drafter, tap scale folded in).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dspark_serve.assets.default_model import default_model_path
from dspark_serve.drafter.checkpoint import load_drafter, read_config, save_drafter
from dspark_serve.drafter.draft_vocab import pruned_lm_head
from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.model.target_model import TargetModel
from dspark_serve.ops.cpu_features import native_bf16_cpu
from dspark_serve.training.anchors import anchor_candidates
from dspark_serve.training.cache_batch import draft_index_map, sequence_targets
from dspark_serve.training.checkpointing import (latest_checkpoint, optimizer_and_schedule,
                                                  save_checkpoint)
from dspark_serve.training.draft_space_loss import draft_space_loss
from dspark_serve.training.feature_cache import FeatureCache
from dspark_serve.training.heldout_accept import heldout_acceptance
from dspark_serve.training.losses import ALPHA_CE, ALPHA_CONF, ALPHA_TV, position_weights
from dspark_serve.training.models import init_weights
from dspark_serve.training.shared_context import fold_tap_scale, shared_context_forward
from dspark_serve.training.trainer import batch_for_step

_PROBE_STEPS = 3
# sequences whose taps set the tap scale (deterministic: the cache's first ones)
_TAP_NORM_SEQS = 32


@dataclass
class CacheTrainConfig:
    """Hyperparameters of one cached-feature run (CLI flags map onto them one to one)."""

    cache: list[str]
    out: str
    init_from: str
    eval_cache: str | None = None
    model: str | None = None
    reinit: bool = False
    mask_token_id: int | None = None
    rope_theta: float | None = None
    tap_norm: bool = False
    anchor_context: bool = False
    steps: int = 2000
    seqs_per_step: int = 2
    anchors_per_seq: int = 128
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    alpha_ce: float = ALPHA_CE
    alpha_tv: float = ALPHA_TV
    alpha_conf: float = ALPHA_CONF
    loss_decay: float = 4.0
    seed: int = 0
    save_every: int = 100
    log_every: int = 10
    eval_every: int = 200
    eval_seqs: int = 40
    keep: int = 2
    time_budget_minutes: float | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("steps", "seqs_per_step", "anchors_per_seq", "save_every", "log_every",
                     "eval_every", "eval_seqs", "keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.cache:
            raise ValueError("at least one training cache is needed")
        if not self.loss_decay > 0:
            raise ValueError(f"loss_decay must be > 0, got {self.loss_decay}")


def tap_scale_from_cache(cache: FeatureCache, num_taps: int, hidden: int) -> torch.Tensor:
    """[num_taps * hidden] float32: 1 / RMS of each tap over the first sequences' tokens
    (issue 15: tap RMS ranges 2.9 to 30 between layers 1 and 28)."""
    taps = torch.cat([cache[i].taps.float() for i in range(min(_TAP_NORM_SEQS, len(cache)))])
    rms = taps.view(-1, num_taps, hidden).pow(2).mean(dim=(0, 2)).sqrt()
    return (1.0 / rms).repeat_interleave(hidden)


def build_drafter(cfg: CacheTrainConfig, target, resume_from: Path | None) -> DSparkDrafter:
    """The float32 drafter of a run: resumed, warm-started from ``init_from``, or (``reinit``)
    ``init_from``'s shape and draft vocabulary with seeded weights. Raises ValueError when
    ``init_from`` has no pruned draft vocabulary (run ``dspark-serve prune-vocab``)."""
    source = resume_from or Path(cfg.init_from)
    dcfg = read_config(source)
    if dcfg.draft_vocab_size is None:
        raise ValueError(f"{source} has no pruned draft vocabulary: run `dspark-serve "
                         "prune-vocab` on it first")
    drafter = load_drafter(source, target.embed_tokens, target.lm_head, dtype=torch.float32,
                           device=cfg.device)
    overrides = {k: v for k, v in (("mask_token_id", cfg.mask_token_id),
                                   ("rope_theta", cfg.rope_theta),
                                   ("anchor_context", cfg.anchor_context or None)) if v is not None}
    if resume_from is None and (cfg.reinit or overrides):
        new_cfg = replace(dcfg, **overrides)
        fresh = DSparkDrafter(new_cfg, target.embed_tokens,
                              pruned_lm_head(target.lm_head.weight, drafter.draft_vocab))
        if cfg.reinit:
            init_weights(fresh, cfg.seed)
            fresh.d2t.copy_(drafter.d2t)
        else:
            fresh.load_state_dict(drafter.state_dict())
        drafter = fresh
    return drafter.float().to(cfg.device).train()


def _step_loss(drafter, caches, order, step, cfg, head_rows, to_draft, tap_scale, gamma):
    """Forward + backward of one step (gradients accumulated). Returns (summed LossTerms
    fields, position-1 train match rate, blocks)."""
    picks = batch_for_step(order, step, cfg.seqs_per_step, cfg.seed)
    c = drafter.config
    work = []
    for slot, (ci, si) in enumerate(picks):
        seq = caches[ci][si].to(cfg.device)
        cand = anchor_candidates(seq.loss_mask)
        cand = cand[cand >= 1]
        if cand.numel() == 0:
            continue
        if cand.numel() > cfg.anchors_per_seq:
            gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 64 + slot)
            cand = cand[torch.randperm(cand.numel(), generator=gen)[:cfg.anchors_per_seq]]
            cand = cand.sort().values
        tg = sequence_targets(seq, cand, block_size=c.block_size, label_offset=c.label_offset,
                              head_rows=head_rows, to_draft=to_draft)
        work.append((seq, cand, tg))
    w = position_weights(gamma, cfg.loss_decay).to(cfg.device)
    norm = sum((w * tg.label_mask.float()).sum() for _, _, tg in work).clamp_min(1e-12)
    sums = {"loss": 0.0, "ce": 0.0, "tv": 0.0, "conf": 0.0}
    match1, blocks = [], 0
    device_type = torch.device(cfg.device).type
    for seq, cand, tg in work:
        # bf16 autocast on a GPU, and on a CPU only where it has bf16 dot products: emulated,
        # it made a block 3.5x slower than float32 (29-31 vs 8.5 ms, AVX512-VNNI-only Xeon)
        with torch.autocast(device_type, dtype=torch.bfloat16,
                            enabled=device_type != "cpu" or native_bf16_cpu()):
            logits, conf, _ = shared_context_forward(drafter, seq.taps, seq.ids, cand,
                                                     tap_scale=tap_scale)
        terms, match = draft_space_loss(
            logits, tg.target_probs, tg.greedy, tg.label_mask,
            conf_logits=conf if drafter.confidence_head is not None else None,
            alpha_ce=cfg.alpha_ce, alpha_tv=cfg.alpha_tv, alpha_conf=cfg.alpha_conf,
            decay=cfg.loss_decay, normalizer=norm)
        terms.total.backward()
        sums["loss"] += float(terms.total.detach())
        for k in ("ce", "tv", "conf"):
            sums[k] += float(getattr(terms, k))
        match1.append(match[:, 0][tg.label_mask[:, 0]])
        blocks += int(cand.numel())
    return sums, float(torch.cat(match1).float().mean()), blocks


def train_cached(cfg: CacheTrainConfig, *, target=None, caches=None, eval_sequences=None,
                 log_fn=print) -> Path:
    """Run (or resume) a cached-feature training run on ``cfg.device``; returns ``final/``.

    Args:
        target: object with ``embed_tokens`` and ``lm_head`` (the frozen target's modules;
            None: load ``cfg.model``, default SmolLM2-135M-Instruct, in bf16 on ``cfg.device``).
        caches, eval_sequences: sequences held in memory instead of ``cfg.cache`` and
            ``cfg.eval_cache`` (lists of lists / a list of ``CachedSequence``, e.g. computed on
            the GPU that trains; ``cfg.cache`` then only names them in the logs).
    Raises:
        ValueError: bad config, an ``init_from`` without a pruned vocabulary, or an empty cache.
    """
    if target is None:

        target = TargetModel.from_pretrained(cfg.model or default_model_path(), dtype="bfloat16",
                                             device=cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    resume_from = latest_checkpoint(out)
    drafter = build_drafter(cfg, target, resume_from)
    caches = caches if caches is not None else [FeatureCache(p) for p in cfg.cache]
    order = [(ci, si) for ci, c in enumerate(caches) for si in range(len(c))]
    if not order:
        raise ValueError(f"the caches {cfg.cache} hold no sequences")
    eval_cache = eval_sequences if eval_sequences is not None else \
        FeatureCache(cfg.eval_cache) if cfg.eval_cache else None
    dc = drafter.config
    head_rows = drafter.shared_modules[1].weight.float()
    to_draft = draft_index_map(drafter.draft_vocab, dc.vocab_size)
    tap_scale = None
    if cfg.tap_norm:
        tap_scale = tap_scale_from_cache(caches[0], len(dc.target_layer_ids),
                                         dc.hidden_size).to(cfg.device)
        if resume_from is None and not cfg.reinit:
            fold_tap_scale(drafter, 1.0 / tap_scale)   # same function, new parametrisation
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer, scheduler, plan, step = optimizer_and_schedule(params, cfg, resume_from)

    def evaluate(at: int) -> None:
        if eval_cache is None:
            return
        t0 = time.perf_counter()
        res = heldout_acceptance(drafter, eval_cache, max_seqs=cfg.eval_seqs,
                                 tap_scale=tap_scale)
        res.update(step=at, seconds=time.perf_counter() - t0)
        with open(out / "eval_log.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(res) + "\n")
        log_fn(f"eval step {at}: pos1 {res['pos1']:.4f} tau {res['tau']:.3f} "
               f"({res['anchors']} anchors)")

    if step == 0:
        evaluate(0)
    began, timed = time.perf_counter(), []
    on_cpu = torch.device(cfg.device).type == "cpu"   # else wall time: the CPU only waits
    with open(out / "train_log.jsonl", "a", encoding="utf-8") as log:
        while step < plan["total"]:
            t0, c0 = time.perf_counter(), time.process_time()
            optimizer.zero_grad(set_to_none=True)
            sums, match1, blocks = _step_loss(drafter, caches, order, step, cfg, head_rows,
                                              to_draft, tap_scale, dc.gamma)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            seconds = time.perf_counter() - t0
            cpu = time.process_time() - c0
            timed.append(seconds)
            if not plan["fixed"] and len(timed) == _PROBE_STEPS + 1:
                per_step = sum(timed[1:]) / _PROBE_STEPS
                left = 60 * cfg.time_budget_minutes - (time.perf_counter() - began)
                plan.update(total=min(cfg.steps, step + 1 + max(0, int(left / per_step))),
                            fixed=True)
                log_fn(f"time budget: {per_step:.2f} s/step -> {plan['total']} steps")
            step += 1
            if step % cfg.log_every == 0 or step == plan["total"]:
                rec = {"step": step, **sums, "train_match1": match1, "blocks": blocks,
                       "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                       "seconds": seconds, "cpu_seconds": cpu,
                       "ms_per_block": 1000 * (cpu if on_cpu else seconds) / max(blocks, 1)}
                log.write(json.dumps(rec) + "\n")
                log.flush()
                log_fn(f"step {step}/{plan['total']} loss {sums['loss']:.3f} ce {sums['ce']:.2f}"
                       f" tv {sums['tv']:.3f} match1 {match1:.3f} "
                       f"{rec['ms_per_block']:.2f} ms/block ({'cpu' if on_cpu else 'wall'})")
            if step % cfg.save_every == 0 or step == plan["total"]:
                save_checkpoint(out, step, drafter, optimizer, scheduler, cfg, cfg.keep,
                                total_steps=plan["total"])
            if step % cfg.eval_every == 0 or step == plan["total"]:
                evaluate(step)
    final = out / "final"
    shipped = DSparkDrafter(drafter.config, *drafter.shared_modules)
    shipped.load_state_dict(drafter.state_dict())
    if tap_scale is not None:
        fold_tap_scale(shipped, tap_scale)
    save_drafter(shipped.to(torch.bfloat16), final)
    return final
