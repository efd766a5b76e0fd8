"""Our drafter architecture in SGLang's ModelRegistry, under ``DRAFTER_ARCHITECTURE``.

The class runs on SGLang's paged draft machinery (its model runner, KV pool, attention backends
and CUDA graphs need an SGLang model), so it extends SGLang's ``Qwen3DSparkModel`` (same
DeepSpec tensor names, ``sglang/srt/models/dspark.py``) and adds our checkpoint contract: the
config must parse with ``DSparkConfig.from_deepspec_dict`` (DeepSpec format, label offset 0, the
head types we implement), so a checkpoint we cannot train, calibrate or serve on the embedded
engine is refused with our ValueError instead of loading with other semantics.
"""
from __future__ import annotations

from typing import Any

from dspark_serve.drafter.config import DEEPSPEC_ARCHITECTURE, DSparkConfig


def check_drafter_config(config: dict[str, Any]) -> DSparkConfig:
    """Our ``DSparkConfig`` of a draft HF config dict (any ``architectures`` value: the draft
    worker renames it). Raises ValueError as ``DSparkConfig.from_deepspec_dict`` does, and for
    a pruned draft vocabulary or an ``anchor_context`` input, which SGLang's DSpark model
    (full-vocabulary LM head and Markov W2, anchor slot fed its embedding only) cannot run:
    serve those drafters on the embedded engine."""
    parsed = DSparkConfig.from_deepspec_dict({**config, "architectures": [DEEPSPEC_ARCHITECTURE]})
    if parsed.draft_vocab_size is not None:
        raise ValueError(f"draft_vocab_size {parsed.draft_vocab_size}: SGLang's DSpark drafter has "
                         "no pruned draft vocabulary; use a full-vocabulary drafter with "
                         "--backend sglang")
    if parsed.anchor_context:
        raise ValueError("anchor_context: SGLang's DSpark drafter feeds the anchor slot its "
                         "embedding only; use a drafter without it with --backend sglang")
    return parsed


def model_class():
    """The registered class (imports sglang's model code)."""
    from sglang.srt.models.dspark import Qwen3DSparkModel

    class DSparkServeDrafter(Qwen3DSparkModel):
        """SGLang's DSpark draft model behind our checkpoint contract (module docstring)."""

        def __init__(self, config, quant_config=None, prefix: str = "") -> None:
            self.dspark_config = check_drafter_config(config.to_dict())
            super().__init__(config, quant_config=quant_config, prefix=prefix)

    return DSparkServeDrafter
