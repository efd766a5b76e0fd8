"""Configuration of the embedded engine (``dspark-serve serve`` flags map onto it one to one)."""
from __future__ import annotations

from dataclasses import dataclass

from dspark_serve.drafter.config import DRAFTER_KINDS
from dspark_serve.model.kv_cache import PAGE_SIZE
from dspark_serve.scheduling import SCHEDULER_NAMES
from dspark_serve.types import DTYPES

SPECULATIVE_MODES = ("none", *DRAFTER_KINDS, "ngram", "hybrid")
# modes that run the drafter / prompt lookup
DRAFTER_MODES = (*DRAFTER_KINDS, "hybrid")
LOOKUP_MODES = ("ngram", "hybrid")
# ``corpus`` value naming the corpus shipped for the target
SHIPPED = "shipped"
QUANTIZATIONS = ("none", "int4")
# Default KV pool per running request (kv_cache_tokens): the former per-slot reservation.
POOL_TOKENS_PER_SEQ = 2048


@dataclass
class EngineConfig:
    """Everything ``LLMEngine`` needs to start.

    model: HF folder of the target (Llama / Qwen2 / Qwen3 family); None = the default
        SmolLM2-135M-Instruct, converted once from its GGUF file and cached.
    draft: DeepSpec or DFlash drafter checkpoint folder; None = the default drafter.
    speculative: "none" (plain decoding), "dflash" (parallel backbone only, fixed gamma),
        "dspark" (backbone + sequential head + confidence head + scheduler), "ngram" (prompt
        lookup alone) or "hybrid" (default: prompt lookup where it matches at least
        ``lookup_min_match`` tokens and its draft is expected to get more drafts accepted
        than the drafter's, the DSpark drafter otherwise; one scheduled pool; the highest
        accepted length of the shipped proposers, TRAINING.md).
    scheduler: verify-length scheduler, "algorithm1" (paper Algorithm 1), "async" (Section 5.2),
        "static" (verify the whole block) or "threshold" (static confidence threshold).
    gamma: draft tokens per round; None = the drafter's trained block size (a smaller gamma
        runs the drafter's block cut to its first gamma positions: fewer rows per draft).
    cost_table: SPS cost table JSON (SGLang format); None = profile this machine at startup.
    calibration: STS calibration JSON; None = the calibration shipped with the drafter.
    max_model_len: context limit in tokens (prompt + completion) per request; None = the
        model's own (``max_position_embeddings``, 8192 for the default model).
    max_num_seqs: most requests running in one step; more wait in the queue.
    kv_cache_tokens: size of the target's KV page pool in token positions, shared by all
        running requests (``model.kv_cache``: pages of 64 positions, 22.5 KiB per position
        in bfloat16 on the default model); at least max_model_len. None = max_num_seqs times
        min(POOL_TOKENS_PER_SEQ = 2048, max_model_len) in whole pages, but at least
        max_model_len: what the former cache of one max_model_len slot per request held up to
        2048 (720 MiB by default), and one request of the full context. Requests are admitted
        when pages are free (``LLMEngine``).
    seed: seed of the engine's global RNG (requests without their own seed draw from it).
    dtype: weight and activation dtype of the target and drafter. "bfloat16" (default) is what
        the shipped drafters were trained against, runs 2-6x faster on CPUs with AVX512-BF16 /
        AMX, and its logits are bit-identical however a step is composed (batch-invariant
        attention and matmuls); "float32" is the reference for comparisons with transformers.
    quantization: "none" (default: weights in ``dtype``) or "int4": the target's decoder-layer
        projections as 4-bit weights with a scale and zero per 32 (GGUF Q4_1's layout; the
        default model's layers *are* Q4_1, so this serves their own 4-bit grid). On CPUs with
        AVX512-VNNI or AVX2 our kernel runs them with int8 activations and an 8-bit LM head, and each
        decoder layer as one compiled call (``ops.quantized_linear``; llama.cpp's arithmetic,
        ~4x faster decoding than bfloat16); elsewhere torch's int4 kernel with bfloat16
        activations and head (``model.linear.Int4Linear``). Needs dtype "bfloat16".
    always_draft: draft every step. By default the async scheduler skips drafting in steps
        where the drafter's measured time costs more throughput than its expected accepted
        tokens bring (then the step is a plain decode step); this turns that off, e.g. to
        test or benchmark the speculative path itself.
    threshold: survival-probability cut-off of the "threshold" scheduler, in [0, 1].
    max_batch_tokens: most target tokens per step (prefill chunks + verify budget B);
        None = the cost table's ``max_batch_tokens``.
    prefill_chunk: most prompt tokens of one request prefilled in one step.
    lookup_min_match: hybrid: shortest suffix match that prompt lookup may draft a row with
        (1: any match; past it, a row is lookup's only where its match's expected accepted
        drafts exceed the drafter's, both from served outcomes: with the shipped SmolLM2
        drafter, 1-token matches go to the drafter, see TRAINING.md).
    lookup_calibration: prompt-lookup survival table JSON (``calibration.lookup``); None =
        the table shipped for the target, if any.
    corpus: hybrid: corpus lookup beside prompt lookup (``drafter.corpus_lookup``: drafts from
        the target's answers to other prompts), from a folder holding ``corpus.npz`` and its
        survival table ``lookup_calibration.json`` (``dspark-serve corpus``, ``calibrate
        --kind corpus``), or "shipped" for the target's shipped corpus; None = off (on
        MT-Bench at one to four users on a CPU it served within a few percent of hybrid
        without it, README).
    draft_vocab_size: prune the drafter's draft vocabulary to the N most frequent target
        tokens of its folder's token ranking while loading (FR-Spec; lossless: draft
        probability 0 outside): None = ``DRAFT_VOCAB_SIZE`` (8192) where the drafter ships a
        ranking (the shipped DSpark drafter does; drafts ~2x cheaper on a CPU), else its own
        vocabulary; 0 = its own vocabulary.
    mask_drafts: for grammar-constrained requests, restrict each draft distribution to the
        tokens the grammar allows (redrawing forbidden drafts) before verification; False
        verifies the drafter's block as drafted (forbidden drafts are then rejected). Both
        are lossless; masking raises acceptance (``dspark_serve.structured.masking``).

    Raises:
        ValueError: a field is out of range or names an unknown mode.
    """

    model: str | None = None
    draft: str | None = None
    speculative: str = "hybrid"
    scheduler: str = "async"
    gamma: int | None = None
    cost_table: str | None = None
    calibration: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 16
    kv_cache_tokens: int | None = None
    seed: int = 0
    dtype: str = "bfloat16"
    quantization: str = "none"
    always_draft: bool = False
    threshold: float = 0.5
    max_batch_tokens: int | None = None
    prefill_chunk: int = 256
    lookup_min_match: int = 1
    lookup_calibration: str | None = None
    corpus: str | None = None
    draft_vocab_size: int | None = None
    mask_drafts: bool = True

    def __post_init__(self) -> None:
        for name, value, allowed in (("speculative", self.speculative, SPECULATIVE_MODES),
                                     ("scheduler", self.scheduler, SCHEDULER_NAMES),
                                     ("dtype", self.dtype, DTYPES),
                                     ("quantization", self.quantization, QUANTIZATIONS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        for name in ("max_model_len", "max_num_seqs", "kv_cache_tokens", "prefill_chunk", "gamma",
                     "max_batch_tokens", "lookup_min_match"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if self.draft_vocab_size is not None and (isinstance(self.draft_vocab_size, bool) or not
                                                  isinstance(self.draft_vocab_size, int)
                                                  or self.draft_vocab_size < 0):
            raise ValueError(f"draft_vocab_size must be an integer >= 0; got "
                             f"{self.draft_vocab_size!r}")
        if self.quantization != "none" and self.dtype != "bfloat16":
            raise ValueError(f"quantization {self.quantization!r} needs dtype bfloat16; got "
                             f"{self.dtype!r}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1]; got {self.threshold!r}")

    def kv_pool_tokens(self, max_model_len: int) -> int:
        """Token positions of the KV page pool once the context limit ``max_model_len`` is
        resolved (see ``kv_cache_tokens``).

        Raises:
            ValueError: an explicit kv_cache_tokens below max_model_len.
        """
        if self.kv_cache_tokens is None:
            per_seq = -(-min(POOL_TOKENS_PER_SEQ, max_model_len) // PAGE_SIZE) * PAGE_SIZE
            return max(self.max_num_seqs * per_seq, max_model_len)
        if self.kv_cache_tokens < max_model_len:
            raise ValueError(f"kv_cache_tokens ({self.kv_cache_tokens}) must hold one request of "
                             f"the context limit ({max_model_len} tokens)")
        return self.kv_cache_tokens
