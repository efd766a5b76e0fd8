"""Training checkpoints: ``step-NNNNNN/`` folders with the drafter in DeepSpec format (float32,
``save_drafter``) and ``trainer_state.pt`` (optimizer, LR scheduler, step, run config). A
folder counts only once its state file exists; it is written under a temporary name and
renamed, so an interrupted save never leaves a half checkpoint that resume would pick."""
from __future__ import annotations

import math
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from dspark_serve.drafter.checkpoint import save_drafter
from dspark_serve.drafter.model import DSparkDrafter

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def latest_checkpoint(out: str | Path) -> Path | None:
    """The complete ``step-N`` folder with the largest N (None if there is none)."""
    found = [(int(m.group(1)), p) for p in Path(out).glob("step-*")
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return max(found)[1] if found else None


def save_checkpoint(out: Path, step: int, drafter: DSparkDrafter, optimizer, scheduler,
                    cfg, keep: int, total_steps: int) -> Path:
    """Write ``step-{step}`` atomically (temporary folder, then rename); prune older ones."""
    final = out / f"step-{step:06d}"
    tmp = out / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(drafter, tmp)
    torch.save({"step": step, "total_steps": total_steps, "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "config": asdict(cfg)}, tmp / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    old = sorted(p for p in out.glob("step-*") if _STEP_DIR.match(p.name))
    for p in old[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def lr_lambda(step: int, total: int, warmup_ratio: float) -> float:
    """Linear warmup over ceil(warmup_ratio * total) steps, then cosine decay to 0."""
    warmup = max(1, math.ceil(warmup_ratio * total))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def optimizer_and_schedule(params, cfg, resume_from: Path | None):
    """AdamW (betas 0.9 / 0.95, ``cfg.lr``, ``cfg.weight_decay``) with warmup + cosine decay
    over ``plan["total"]`` steps, restored from ``resume_from``'s state when given.

    Returns (optimizer, scheduler, plan, first step). ``plan`` is a dict {"total", "fixed"}: a
    run with ``cfg.time_budget_minutes`` may lower "total" once (the schedule reads it live);
    a resumed run keeps the total stored in its checkpoint.
    """
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)
    plan = {"total": cfg.steps, "fixed": cfg.time_budget_minutes is None}
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, plan["total"], cfg.warmup_ratio))
    start = 0
    if resume_from is not None:
        state = torch.load(resume_from / STATE_FILE, weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = int(state["step"])
        plan.update(total=int(state.get("total_steps", cfg.steps)), fixed=True)
    return optimizer, scheduler, plan, start
