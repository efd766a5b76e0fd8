"""The models of a training run: the frozen target tapped at the drafter's layers and the
drafter (default shape with seeded initialisation, a drafter folder to warm-start from, or a
checkpoint being resumed)."""
from __future__ import annotations

from pathlib import Path

import torch

from dspark_serve.assets.default_drafter import default_drafter_config
from dspark_serve.assets.default_model import MODEL_NAME, default_model_path
from dspark_serve.drafter.checkpoint import load_drafter
from dspark_serve.drafter.checkpoint import read_config
from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.model.target_model import TargetModel


def init_weights(drafter: DSparkDrafter, seed: int) -> None:
    """Seeded initialisation: linear weights N(0, 0.02) with zero biases (transformers'
    default), Markov W1 N(0, 1) and W2 = 0 so the sequential bias starts at zero and the
    untrained drafter is exactly its DFlash backbone."""
    gen = torch.Generator().manual_seed(seed)
    for module in drafter.modules():
        if isinstance(module, torch.nn.Linear):
            with torch.no_grad():
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.02)
                if module.bias is not None:
                    module.bias.zero_()
    head = drafter.markov_head
    if head is not None:
        with torch.no_grad():
            head.markov_w1.weight.copy_(torch.randn(head.markov_w1.weight.shape, generator=gen))
            head.markov_w2.weight.zero_()


def build_models(cfg, resume_from: Path | None):
    """(target, drafter, model name) for a run: the target (frozen, ``cfg.dtype``) tapped at the
    drafter's layers, and a float32 drafter: the one saved at ``resume_from`` if given, else
    the drafter folder ``cfg.init_from`` (warm start, e.g. a shipped drafter trained further),
    else the default shape with seeded initialisation."""
    from transformers import AutoConfig, AutoTokenizer

    path = cfg.model or default_model_path()
    name = Path(path).name if cfg.model else MODEL_NAME
    source = resume_from or (Path(cfg.init_from) if cfg.init_from else None)
    if source is not None:
        dcfg = read_config(source)
    else:
        tok = AutoTokenizer.from_pretrained(path)
        # the engine's rule for the mask token of a default-shape drafter
        mask_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        dcfg = default_drafter_config(AutoConfig.from_pretrained(path), cfg.kind, mask_id)
    target = TargetModel.from_pretrained(path, dtype=cfg.dtype,
                                         target_layer_ids=dcfg.target_layer_ids)
    if source is not None:
        drafter = load_drafter(source, target.embed_tokens, target.lm_head,
                               dtype=torch.float32, device=target.device)
    else:
        drafter = DSparkDrafter(dcfg, target.embed_tokens, target.lm_head)
        init_weights(drafter, cfg.seed)
        drafter = drafter.to(target.device)
    return target, drafter.train(), name
