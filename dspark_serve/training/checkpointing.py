"""Training checkpoints: ``step-NNNNNN/`` folders with the drafter in DeepSpec format (float32,
``save_drafter``) and ``trainer_state.pt`` (optimizer, LR scheduler, step, run config). A
folder counts only once its state file exists; it is written under a temporary name and
renamed, so an interrupted save never leaves a half checkpoint that resume would pick."""
from __future__ import annotations

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
