"""Drafters for a target when ``--draft`` is not given.

A trained drafter shipped for the target (``dspark_serve/assets/drafters/<target>/<kind>``,
DeepSpec format, issue 4) is used when present. Otherwise the engine builds an untrained
drafter of the default shape, seeded so every start is identical: it runs the whole DSpark
pipeline but accepts almost nothing, which keeps outputs exact (verification is lossless)
and only costs speed. A warning says so.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from dspark_serve.calibration.lookup import FILE_NAME as LOOKUP_FILE_NAME
from dspark_serve.drafter.corpus_lookup import FILE_NAME as CORPUS_FILE_NAME
from dspark_serve.drafter.checkpoint import load_drafter, read_config
from dspark_serve.drafter.config import DRAFTER_KINDS, DSparkConfig
from dspark_serve.drafter.draft_vocab import RANKING_FILE, load_ranking, top_tokens
from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.model.linear import QuantizedLinear, pack_linears, quantize_linears

logger = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).parent / "drafters"
# Default drafter shape (issue 4: trainable on a 2-core CPU, <= 40 MB in bf16).
NUM_DRAFT_LAYERS = 2
BLOCK_SIZE = 7
MARKOV_RANK = 64
NUM_TAPS = 5
# Prompt lookup alone drafts as many tokens per round as the default drafter's block.
LOOKUP_GAMMA = BLOCK_SIZE
# Draft vocabulary the engine prunes a shipped drafter to (91 % coverage of SmolLM2's outputs).
# The tokens past the first 8k are rarely drafted and more rarely accepted: served tau (int4,
# static scheduler, 80 MT-Bench / 164 HumanEval / 200 AlpacaEval prompts, 192 tokens; session
# 36) at 16k / 8k / 4k / 2k was 1.708 / 1.707 / 1.702 / 1.689 macro at T = 0, 1.242 / 1.244 at
# T = 1 (16k / 8k), while one request's draft after a verify step took 1.88 / 1.63 / 1.51 ms
# (3 positions; AMD EPYC, one thread).
DRAFT_VOCAB_SIZE = 8192
# The drafter's linears (draft layers, context projection, pruned LM head) under an int4 target:
# a draft reads its weights from memory after the target's step has evicted them, so bytes
# decide. 4-bit against 8-bit (session 36, AMD EPYC, one thread, after a 2-token verify step):
# one request's context update and draft of 1 / 3 / 7 positions 2.32 / 2.43 / 3.05 -> 1.80 /
# 1.95 / 2.52 ms; served tau (static scheduler, greedy, 80 MT-Bench / 164 HumanEval / 200
# AlpacaEval prompts, 192 tokens) 1.712 -> 1.708 macro. The Markov W2 stays 8-bit
# (markov_head.compile_draw: 1 MB).
DRAFTER_WEIGHT_BITS = 4
# The shipped DSpark drafter feeds its anchor slot the context state (``anchor_context``),
# which SGLang's DSpark model cannot; SGLang serves the earlier drafter kept in this folder.
SGLANG_DRAFTER_KIND = "dspark-sglang"


def shipped_lookup_calibration(model_name: str) -> Path | None:
    """The prompt-lookup survival table shipped for a target (``<target>/ngram/``), if any."""
    path = SHIPPED_DIR / model_name / "ngram" / LOOKUP_FILE_NAME
    return path if path.is_file() else None


def shipped_corpus(model_name: str) -> Path | None:
    """The corpus-lookup folder shipped for a target (``<target>/corpus/``), if any."""
    folder = SHIPPED_DIR / model_name / "corpus"
    return folder if (folder / CORPUS_FILE_NAME).is_file() else None


def shipped_drafter_path(model_name: str, kind: str) -> Path | None:
    """The shipped drafter folder of ``kind`` ("dspark" | "dflash" | SGLANG_DRAFTER_KIND) for
    a target, if any."""
    folder = SHIPPED_DIR / model_name / kind
    return folder if (folder / "config.json").is_file() else None


def evenly_spaced_taps(num_layers: int, num_taps: int = NUM_TAPS) -> list[int]:
    """``num_taps`` target layers from layer 1 to the last-but-one, as DFlash spaces them."""
    if num_layers < 3:
        return list(range(num_layers))
    num_taps = min(num_taps, num_layers - 1)
    last = num_layers - 2
    return sorted({1 + round(i * (last - 1) / max(num_taps - 1, 1)) for i in range(num_taps)})


def default_drafter_config(target_config, kind: str, mask_token_id: int) -> DSparkConfig:
    """The default drafter shape for a transformers target config: NUM_DRAFT_LAYERS layers at the
    target's width; "dspark" adds a Markov head of rank MARKOV_RANK and a confidence head,
    "dflash" is the same backbone without them (the paper's ablation baseline)."""
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"drafter kind must be one of {DRAFTER_KINDS}, got {kind!r}")
    hidden = target_config.hidden_size
    heads = target_config.num_attention_heads
    dspark = kind == "dspark"
    return DSparkConfig(
        hidden_size=hidden, num_hidden_layers=NUM_DRAFT_LAYERS, num_attention_heads=heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
        intermediate_size=target_config.intermediate_size, vocab_size=target_config.vocab_size,
        block_size=BLOCK_SIZE, mask_token_id=mask_token_id,
        target_layer_ids=evenly_spaced_taps(target_config.num_hidden_layers),
        num_target_layers=target_config.num_hidden_layers,
        rms_norm_eps=target_config.rms_norm_eps,
        markov_rank=MARKOV_RANK if dspark else 0, enable_confidence_head=dspark,
        confidence_head_with_markov=dspark)


def drafter_source(target_config, kind: str, model_name: str, mask_token_id: int,
                   path: str | None = None) -> tuple[str | None, DSparkConfig]:
    """Where the engine's drafter comes from and its config (read before the target loads,
    because the config names the target layers to tap): ``path`` if given, else the shipped
    drafter for ``model_name``, else (None, the untrained default shape).

    Raises:
        ValueError: a checkpoint config that does not fit the target (vocabulary, hidden size,
            number of target layers).
    """
    path = path or shipped_drafter_path(model_name, kind)
    config = (read_config(path) if path is not None
              else default_drafter_config(target_config, kind, mask_token_id))
    if (config.vocab_size, config.hidden_size) != (target_config.vocab_size, target_config.hidden_size):
        raise ValueError(f"drafter (vocab {config.vocab_size}, hidden {config.hidden_size}) does "
                         f"not fit the target (vocab {target_config.vocab_size}, hidden "
                         f"{target_config.hidden_size})")
    if config.num_target_layers != target_config.num_hidden_layers:
        raise ValueError(f"drafter was trained on a {config.num_target_layers}-layer target; "
                         f"this target has {target_config.num_hidden_layers} layers")
    return (str(path) if path is not None else None), config


def draft_vocab_ids(path: str | None, config: DSparkConfig,
                    size: int | None) -> torch.Tensor | None:
    """The draft vocabulary the engine prunes the drafter at ``path`` to while loading: [N]
    int64 ascending target ids, the first N of the folder's token ranking
    (``draft_vocab.RANKING_FILE``), N = ``size`` or DRAFT_VOCAB_SIZE when None; None = keep
    the drafter's vocabulary (size 0, no ranking with size None, an untrained or an already
    pruned drafter with size None).

    Raises:
        ValueError: a size > 0 for a drafter without a ranking or already pruned, or a size
            outside 0..V.
    """
    if size == 0:
        return None
    ranking = load_ranking(path) if path is not None else None
    if size is None:
        if ranking is None or config.draft_vocab_size is not None:
            return None
        size = min(DRAFT_VOCAB_SIZE, config.vocab_size)
    if ranking is None or config.draft_vocab_size is not None:
        raise ValueError(f"draft_vocab_size {size} needs a drafter with a full vocabulary and a "
                         f"token ranking ({RANKING_FILE}, written by dspark-serve prune-vocab "
                         f"--ranking-only); {path} has "
                         + ("a pruned vocabulary" if config.draft_vocab_size is not None
                            else "no ranking"))
    if ranking.numel() != config.vocab_size:
        raise ValueError(f"{path}: the token ranking has {ranking.numel()} ids, the drafter's "
                         f"vocabulary {config.vocab_size}")
    return top_tokens(ranking, size)


def build_drafter(target, path: str | None, config: DSparkConfig, *, seed: int = 0,
                  draft_vocab: torch.Tensor | None = None) -> DSparkDrafter:
    """Load the drafter at ``path`` onto the target's embedding and LM head, or build an
    untrained one of ``config`` (seeded, with a warning) when ``path`` is None, for inference:
    weights take the target's dtype and device, the LM head is the target's serving head and
    the linears are packed where that is faster (``pack_linears``), or quantized to
    ``DRAFTER_WEIGHT_BITS`` bits through our kernel for an int4 target that uses it
    (``quantize_linears``); no gradients.

    Args:
        target: ``dspark_serve.model.target_model.TargetModel``.
        draft_vocab: [N] int64 ascending ids to prune the draft vocabulary to while loading
            (``draft_vocab_ids``), or None.
    """
    if path is not None:
        # a pruned draft vocabulary slices rows of the LM head's weight (the serving head is
        # packed and has none); its head is packed below like the drafter's own linears
        pruned = config.draft_vocab_size is not None or draft_vocab is not None
        head = target.lm_head if pruned else target.head_logits
        drafter = load_drafter(path, target.embed_tokens, head, dtype=target.dtype,
                               device=target.device, draft_vocab=draft_vocab)
    else:
        logger.warning("no trained drafter for this target: using an untrained one (outputs "
                       "stay exact, acceptance will be near zero)")
        with torch.random.fork_rng():  # seeded init without touching the caller's RNG
            torch.manual_seed(seed)
            drafter = DSparkDrafter(config, target.embed_tokens, target.head_logits)
        drafter = drafter.to(device=target.device, dtype=target.dtype)
    drafter.eval().requires_grad_(False)
    # an int4 target on our kernel: the drafter's linears 4-bit through it; else oneDNN-packed
    # bfloat16
    quantized = isinstance(target.weights.head, QuantizedLinear)
    modules = [drafter] + ([drafter.shared_modules[1]] if drafter.draft_vocab is not None else [])
    for module in modules:
        if not (quantized and quantize_linears(module, DRAFTER_WEIGHT_BITS)):
            pack_linears(module)
    if quantized:   # the layers and the Markov draw as compiled calls
        drafter.backbone.compile_layers(DRAFTER_WEIGHT_BITS)
        if drafter.markov_head is not None:
            drafter.markov_head.compile_draw()
    return drafter
