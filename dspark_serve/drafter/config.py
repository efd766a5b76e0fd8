"""DSpark drafter configuration, mirroring DeepSpec's DSpark ``config.json``.

DeepSpec (github deepseek-ai/DeepSpec, ``deepspec/modeling/dspark/qwen3/config.py::
build_draft_config``) writes the draft config as a copy of the target's Qwen3 config with
``architectures = ["Qwen3DSparkModel"]``, the draft depth in ``num_hidden_layers`` and these
top-level keys: ``block_size, mask_token_id, target_layer_ids, num_target_layers, num_anchors,
markov_rank, markov_head_type`` (only when markov_rank > 0), ``enable_confidence_head``,
``confidence_head_with_markov`` (only when the confidence head is on). z-lab's DFlash
(``DFlashDraftModel``) keeps ``block_size`` and ``num_target_layers`` top level and nests
``target_layer_ids`` / ``mask_token_id`` in ``dflash_config``. The label alignment of the two
formats differs; see ``dspark_serve.drafter.checkpoint`` and ``label_offset`` below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Drafter kinds: DFlash (the parallel backbone alone), DSpark (+ sequential and confidence heads).
DRAFTER_KINDS = ("dflash", "dspark")
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
# DeepSpec's released files say "qwen3" (the trunk is a Qwen3 stack); transformers' AutoConfig,
# and so SGLang's draft loader, refuses a config.json without a model_type.
DEEPSPEC_MODEL_TYPE = "qwen3"
DFLASH_ARCHITECTURE = "DFlashDraftModel"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# DeepSpec's released configs (config/dspark/*.py) sample 512 anchors per training sequence;
# its model constructor requires the key, so files we write must carry it.
DEFAULT_NUM_ANCHORS = 512
# Keys of a DFlash ``dflash_config`` that describe variants this loader does not implement.
_UNSUPPORTED_DFLASH_KEYS = ("projector_type", "markov_rank", "sample_from_anchor", "shift_label")


@dataclass
class DSparkConfig:
    """Drafter hyperparameters (Qwen3-style draft layers, DFlash backbone, DSpark heads).

    ``block_size`` counts the input slots of one block (anchor + block_size - 1 mask tokens,
    at positions anchor_pos + 0..block_size-1). ``label_offset`` is the first slot whose
    output is a draft logit: 0 in DeepSpec (slot j predicts x_{j+1}; gamma = block_size), 1 in
    z-lab DFlash (slot j predicts x_j; the anchor's output is unused; gamma = block_size - 1).
    ``draft_vocab_size`` N prunes the draft output vocabulary to N target tokens (their ids in
    the checkpoint's ``d2t``, ``dspark_serve.drafter.draft_vocab``); None = the full vocabulary.
    ``anchor_context`` also feeds the anchor slot the context state of the position before
    the anchor, x_0 = embed(anchor) + H_ctx[p - 1] (EAGLE-style input; issue 15; our
    extension of the DeepSpec format, key ``anchor_context``, absent = False).
    ``extra`` keeps every other config.json key so a load/save round trip is lossless.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    num_anchors: int = DEFAULT_NUM_ANCHORS
    label_offset: int = 0
    draft_vocab_size: int | None = None
    anchor_context: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    @property
    def gamma(self) -> int:
        """Draft tokens per block (the block size gamma of the paper)."""
        return self.block_size - self.label_offset

    @property
    def context_dim(self) -> int:
        """Width of the concatenated target hidden taps, len(target_layer_ids) * hidden_size."""
        return len(self.target_layer_ids) * self.hidden_size

    def validate(self) -> None:
        """Raises ValueError on inconsistent values (the checks DeepSpec asserts, as errors)."""
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                     "num_target_layers", "num_anchors"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} must be a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.label_offset not in (0, 1):
            raise ValueError(f"label_offset must be 0 or 1, got {self.label_offset}")
        if self.gamma < 1:
            raise ValueError(f"block_size {self.block_size} leaves no draft position "
                             f"(label_offset {self.label_offset})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside [0, {self.vocab_size})")
        ids = self.target_layer_ids
        if not ids:
            raise ValueError("target_layer_ids must not be empty")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"target_layer_ids must be strictly increasing, got {ids}")
        if ids[0] < -1 or ids[-1] >= self.num_target_layers:
            raise ValueError(f"target_layer_ids {ids} outside {{-1}} U [0, "
                             f"{self.num_target_layers - 1}] (-1 is the embedding output)")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, "
                             f"got {self.markov_head_type!r}")
        if self.confidence_head_with_markov and not self.enable_confidence_head:
            raise ValueError("confidence_head_with_markov needs enable_confidence_head")
        if self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError("confidence_head_with_markov needs markov_rank > 0")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got "
                             f"{self.draft_vocab_size}")

    # ---- DeepSpec config.json -------------------------------------------------------------

    @classmethod
    def from_deepspec_dict(cls, cfg: dict[str, Any]) -> "DSparkConfig":
        """Parse a DeepSpec DSpark config.json. Raises ValueError on a wrong architecture,
        missing keys, unsupported attention/activation/RoPE settings or bad values."""
        cfg = dict(cfg)
        arch = cfg.pop("architectures", None)
        if arch != [DEEPSPEC_ARCHITECTURE]:
            raise ValueError(f"expected architectures [{DEEPSPEC_ARCHITECTURE!r}], got {arch!r}")
        cfg.pop("model_type", None)  # written back as DEEPSPEC_MODEL_TYPE
        values = _pop_layer_hparams(cfg)
        rank = int(_pop_required(cfg, "markov_rank"))
        conf = bool(_pop_required(cfg, "enable_confidence_head"))
        values.update(
            block_size=int(_pop_required(cfg, "block_size")),
            mask_token_id=int(_pop_required(cfg, "mask_token_id")),
            target_layer_ids=list(_pop_required(cfg, "target_layer_ids")),
            num_target_layers=int(_pop_required(cfg, "num_target_layers")),
            num_anchors=int(cfg.pop("num_anchors", DEFAULT_NUM_ANCHORS)),
            markov_rank=rank,
            draft_vocab_size=_optional_int(cfg.pop("draft_vocab_size", None)),
            anchor_context=bool(cfg.pop("anchor_context", False)),
            markov_head_type=str(_pop_required(cfg, "markov_head_type") if rank > 0
                                 else cfg.pop("markov_head_type", "vanilla")).lower(),
            enable_confidence_head=conf,
            confidence_head_with_markov=bool(_pop_required(cfg, "confidence_head_with_markov")
                                             if conf else cfg.pop("confidence_head_with_markov",
                                                                  False)),
        )
        return cls(**values, label_offset=0, extra=cfg)

    def to_deepspec_dict(self) -> dict[str, Any]:
        """The DeepSpec config.json object. Raises ValueError for a DFlash-aligned config
        (label_offset 1), whose slot semantics the DeepSpec format cannot express."""
        if self.label_offset != 0:
            raise ValueError("a DFlash-aligned drafter (label_offset 1: the anchor's output is "
                             "unused) cannot be written in the DeepSpec format, where the "
                             "anchor's output is the first draft logit")
        out = dict(self.extra)
        out.update(
            architectures=[DEEPSPEC_ARCHITECTURE], model_type=DEEPSPEC_MODEL_TYPE,
            hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps, attention_bias=self.attention_bias,
            hidden_act="silu", layer_types=["full_attention"] * self.num_hidden_layers,
            block_size=self.block_size, mask_token_id=self.mask_token_id,
            target_layer_ids=list(self.target_layer_ids),
            num_target_layers=self.num_target_layers, num_anchors=self.num_anchors,
            markov_rank=self.markov_rank, enable_confidence_head=self.enable_confidence_head,
        )
        # Transformers 5 (DeepSpec pins 5.10) writes RoPE as rope_parameters; older files
        # have a top-level rope_theta. Write back whichever form was read.
        if "rope_parameters" in out:
            out["rope_parameters"] = {**out["rope_parameters"], "rope_theta": self.rope_theta}
        else:
            out["rope_theta"] = self.rope_theta
        if self.draft_vocab_size is not None:
            out["draft_vocab_size"] = self.draft_vocab_size
        if self.anchor_context:
            out["anchor_context"] = True
        if self.markov_rank > 0:
            out["markov_head_type"] = self.markov_head_type
        if self.enable_confidence_head:
            out["confidence_head_with_markov"] = self.confidence_head_with_markov
        return out

    # ---- z-lab DFlash config.json ---------------------------------------------------------

    @classmethod
    def from_dflash_dict(cls, cfg: dict[str, Any]) -> "DSparkConfig":
        """Parse a z-lab ``DFlashDraftModel`` config.json: no Markov or confidence head,
        label_offset 1. A missing ``dflash_config.target_layer_ids`` gets z-lab's default
        (``default_dflash_target_layer_ids``). Raises ValueError on a wrong architecture, a
        missing mask_token_id or an unsupported DFlash variant."""
        cfg = dict(cfg)
        arch = cfg.pop("architectures", None)
        if arch != [DFLASH_ARCHITECTURE]:
            raise ValueError(f"expected architectures [{DFLASH_ARCHITECTURE!r}], got {arch!r}")
        dflash = dict(cfg.get("dflash_config") or {})
        unsupported = [k for k in _UNSUPPORTED_DFLASH_KEYS if dflash.get(k)]
        if unsupported:
            raise ValueError(f"unsupported DFlash variant: dflash_config sets {unsupported}")
        if dflash.get("mask_token_id") is None:
            raise ValueError("dflash_config.mask_token_id is required")
        values = _pop_layer_hparams(cfg)
        num_target_layers = int(_pop_required(cfg, "num_target_layers"))
        layer_ids = dflash.get("target_layer_ids") or default_dflash_target_layer_ids(
            num_target_layers, values["num_hidden_layers"])
        values.update(block_size=int(_pop_required(cfg, "block_size")),
                      mask_token_id=int(dflash["mask_token_id"]), target_layer_ids=layer_ids,
                      num_target_layers=num_target_layers)
        return cls(**values, label_offset=1, extra=cfg)


def default_dflash_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps when a DFlash config omits them: the middle layer for a one-layer
    drafter, else ``num_draft_layers`` layers spaced evenly (rounded) from 1 to
    num_target_layers - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [int(round(first + i * (last - first) / (num_draft_layers - 1)))
            for i in range(num_draft_layers)]


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _pop_required(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config.json lacks required key {key!r}")
    return cfg.pop(key)


def _pop_layer_hparams(cfg: dict[str, Any]) -> dict[str, Any]:
    """Pop the Qwen3 layer hyperparameters shared by both formats (``cfg`` keeps the rest,
    including rope_parameters, which is rewritten on save)."""
    act = cfg.pop("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"only hidden_act 'silu' (SwiGLU) is supported, got {act!r}")
    layer_types = cfg.pop("layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"only full_attention draft layers are supported, got {layer_types}")
    hidden = int(_pop_required(cfg, "hidden_size"))
    heads = int(_pop_required(cfg, "num_attention_heads"))
    head_dim = cfg.pop("head_dim", None)
    return dict(
        hidden_size=hidden, num_hidden_layers=int(_pop_required(cfg, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.pop("num_key_value_heads", heads)),
        head_dim=int(head_dim) if head_dim is not None else hidden // heads,
        intermediate_size=int(_pop_required(cfg, "intermediate_size")),
        vocab_size=int(_pop_required(cfg, "vocab_size")),
        rms_norm_eps=float(cfg.pop("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        attention_bias=bool(cfg.pop("attention_bias", False)),
    )


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for source in (params, scaling):
        kind = source.get("rope_type", source.get("type", "default"))
        if kind != "default":
            raise ValueError(f"only default RoPE is supported, got rope_type {kind!r}")
    theta = params.get("rope_theta", cfg.pop("rope_theta", None))
    if theta is None:
        raise ValueError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    return float(theta)
