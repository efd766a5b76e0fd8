"""The drafter training loop (paper Section 3.3): frozen target, frozen shared embedding and LM
head, random anchors per sequence, losses Eq 8-12, AdamW with warmup + cosine decay.

The same loop trains DSpark (Markov head + confidence head, alpha_ce/tv/conf = 0.1/0.9/1.0)
and the DFlash baseline (``kind="dflash"``: markov_rank 0, no confidence head, CE only),
so the two differ only in what the paper ablates. Training is deterministic given the seed:
step i reads a fixed slice of a seeded per-epoch order and draws its anchors from a generator
seeded by (seed, i), so a resumed run continues exactly where it stopped.

Output folder: ``step-NNNNNN/`` checkpoints (DeepSpec format in float32, written by
``save_drafter``, plus ``trainer_state.pt`` with the optimizer, scheduler and step; the last
``keep`` are kept), ``train_log.jsonl`` (loss terms, per-step seconds) and, at the end,
``final/``: the drafter in bfloat16, the folder to ship. With ``time_budget_minutes`` the run
times its first steps and lowers the step count once so the whole run fits the budget (the
cosine schedule then ends on time); the chosen count is stored in every checkpoint.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_serve.drafter.checkpoint import load_drafter, save_drafter
from dspark_serve.drafter.config import DRAFTER_KINDS
from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.training.anchors import block_layout, sample_anchors
from dspark_serve.training.checkpointing import (latest_checkpoint, optimizer_and_schedule,
                                                  save_checkpoint)
from dspark_serve.training.dataset import Sequence, load_sequences
from dspark_serve.training.forward import drafter_forward
from dspark_serve.training.models import build_models
from dspark_serve.training.losses import ALPHA_CE, ALPHA_CONF, ALPHA_TV, drafter_loss
from dspark_serve.training.target_features import target_features

# steps timed (after the first) before a time budget fixes the step count
_PROBE_STEPS = 3

@dataclass
class TrainConfig:
    """Hyperparameters of one training run (CLI flags map onto them one to one)."""

    data: str
    out: str
    kind: str = "dspark"
    model: str | None = None
    steps: int = 3000
    seqs_per_step: int = 4
    anchors_per_seq: int = 16
    max_len: int = 768
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    alpha_ce: float | None = None
    alpha_tv: float | None = None
    alpha_conf: float | None = None
    loss_decay: float | None = None
    temperature: float = 1.0
    dtype: str = "bfloat16"
    seed: int = 0
    save_every: int = 250
    log_every: int = 10
    keep: int = 2
    time_budget_minutes: float | None = None
    init_from: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"kind must be one of {', '.join(DRAFTER_KINDS)}; got {self.kind!r}")
        for name in ("steps", "seqs_per_step", "anchors_per_seq", "save_every", "log_every",
                     "keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.time_budget_minutes is not None and not self.time_budget_minutes > 0:
            raise ValueError(f"time_budget_minutes must be > 0, got {self.time_budget_minutes}")
        dflash = self.kind == "dflash"
        # DFlash baseline: CE only (no target distribution term, no confidence head)
        for name, dspark_default, dflash_default in (("alpha_ce", ALPHA_CE, 1.0),
                                                     ("alpha_tv", ALPHA_TV, 0.0),
                                                     ("alpha_conf", ALPHA_CONF, 0.0)):
            if getattr(self, name) is None:
                setattr(self, name, dflash_default if dflash else dspark_default)


def batch_for_step(sequences: list[Sequence], step: int, per_step: int,
                   seed: int) -> list[Sequence]:
    """The sequences of step ``step``: consecutive slices of a seeded permutation per epoch."""
    n = len(sequences)
    picked = []
    for i in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(i, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        picked.append(sequences[int(order[offset])])
    return picked


def train_step(drafter: DSparkDrafter, target, batch: list[Sequence], cfg: TrainConfig,
               step: int, autocast: bool):
    """Forward + loss of one step (no optimizer update). Returns (LossTerms, seconds in the
    target, number of blocks)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    anchors = [sample_anchors(s.loss_mask, cfg.anchors_per_seq, gen) for s in batch]
    c = drafter.config
    layout = block_layout([s.ids for s in batch], [s.loss_mask for s in batch], anchors,
                          block_size=c.block_size, label_offset=c.label_offset,
                          mask_token_id=c.mask_token_id)
    needs_target = cfg.alpha_tv != 0 or (cfg.alpha_conf != 0
                                         and drafter.confidence_head is not None)
    t0 = time.perf_counter()
    feats = target_features(target, [s.ids for s in batch], layout, with_logits=needs_target)
    t_target = time.perf_counter() - t0
    layout = layout.to(target.device)
    with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits, conf_logits = drafter_forward(drafter, feats.taps, layout)
    loss = drafter_loss(logits, layout.labels, layout.label_mask, target_logits=feats.logits,
                        conf_logits=conf_logits if drafter.confidence_head is not None else None,
                        alpha_ce=cfg.alpha_ce, alpha_tv=cfg.alpha_tv, alpha_conf=cfg.alpha_conf,
                        decay=cfg.loss_decay or c.gamma, temperature=cfg.temperature)
    return loss, t_target, layout.num_blocks


def train(cfg: TrainConfig, *, progress: bool = True, models=None) -> Path:
    """Run (or resume) training; returns the ``final/`` folder (bfloat16 DeepSpec drafter).

    Args:
        models: optional (target, drafter) to train instead of loading ``cfg.model`` (tests).
    Raises:
        ValueError: no training data, a resumed run whose kind differs, or a drafter with a
            pruned draft vocabulary (``train-cached`` trains those).
    """
    from tqdm import tqdm

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    resume_from = latest_checkpoint(out)
    if models is None:
        target, drafter, _ = build_models(cfg, resume_from)
    else:
        target, drafter = models
        if resume_from is not None:
            drafter.load_state_dict(load_drafter(resume_from, *drafter.shared_modules,
                                                 dtype=torch.float32).state_dict())
    if drafter.draft_vocab is not None:
        # its losses compare full-vocabulary distributions; train-cached works in draft space
        raise ValueError("the drafter has a pruned draft vocabulary: train it with "
                         "`dspark-serve train-cached`")
    if (drafter.markov_head is None) != (cfg.kind == "dflash"):
        raise ValueError(f"the drafter in {out} does not match --kind {cfg.kind}")
    sequences = load_sequences(cfg.data, max_len=cfg.max_len)
    params = [p for p in drafter.parameters() if p.requires_grad]
    # total steps; a time budget may lower it once, after the first timed steps
    optimizer, scheduler, plan, start = optimizer_and_schedule(params, cfg, resume_from)
    autocast = target.dtype == torch.bfloat16
    bar = tqdm(initial=start, total=plan["total"], disable=not progress, desc=f"train {cfg.kind}")
    began, timed = time.perf_counter(), []
    with open(out / "train_log.jsonl", "a", encoding="utf-8") as log:
        step = start
        while step < plan["total"]:
            t0, c0 = time.perf_counter(), time.process_time()
            batch = batch_for_step(sequences, step, cfg.seqs_per_step, cfg.seed)
            loss, t_target, blocks = train_step(drafter, target, batch, cfg, step, autocast)
            optimizer.zero_grad(set_to_none=True)
            loss.total.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            seconds = time.perf_counter() - t0
            timed.append(seconds)
            if not plan["fixed"] and len(timed) == _PROBE_STEPS + 1:
                # the first step pays one-off start-up costs: time the next ones
                per_step = sum(timed[1:]) / _PROBE_STEPS
                left = 60 * cfg.time_budget_minutes - (time.perf_counter() - began)
                plan.update(total=min(cfg.steps, step + 1 + max(0, int(left / per_step))),
                            fixed=True)
                bar.total = plan["total"]
                bar.write(f"time budget: {per_step:.2f} s/step -> {plan['total']} steps")
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.total.detach()):.3f}", ce=f"{float(loss.ce):.2f}",
                            tau=f"{loss.expected_tau:.2f}", refresh=False)
            if (step + 1) % cfg.log_every == 0 or step + 1 == plan["total"]:
                log.write(json.dumps({
                    "step": step + 1, "loss": float(loss.total.detach()), "ce": float(loss.ce),
                    "tv": float(loss.tv), "conf": float(loss.conf),
                    "expected_tau": loss.expected_tau, "accept": loss.accept.tolist(),
                    "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                    "blocks": blocks, "seconds": seconds, "target_seconds": t_target,
                    "cpu_seconds": time.process_time() - c0}) + "\n")
                log.flush()
            if (step + 1) % cfg.save_every == 0 or step + 1 == plan["total"]:
                save_checkpoint(out, step + 1, drafter, optimizer, scheduler, cfg, cfg.keep,
                                total_steps=plan["total"])
            step += 1
    bar.close()
    final = out / "final"
    shipped = DSparkDrafter(drafter.config, *drafter.shared_modules)
    shipped.load_state_dict(drafter.state_dict())
    save_drafter(shipped.to(torch.bfloat16), final)
    return final
