"""``dspark-serve serve``: load the engine and serve it over HTTP (OpenAI API)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from dspark_serve.engine.config import (POOL_TOKENS_PER_SEQ, QUANTIZATIONS, SPECULATIVE_MODES,
                                         EngineConfig)
from dspark_serve.scheduling import SCHEDULER_NAMES
from dspark_serve.types import DTYPES

LOG_LEVELS = ("debug", "info", "warning", "error")
BACKENDS = ("embedded", "sglang")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``serve`` subcommand (its ``func`` runs the server)."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible server with DSpark speculative decoding",
        description="Serve a target model with speculative decoding behind an OpenAI-compatible "
                    "API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).")
    p.add_argument("--model", help="target HF folder (Llama/Qwen2/Qwen3); default: "
                                   "SmolLM2-135M-Instruct, converted once and cached")
    p.add_argument("--draft", help="DeepSpec or DFlash drafter folder; default: the default "
                                   "drafter")
    p.add_argument("--speculative", choices=SPECULATIVE_MODES, default=_DEFAULTS["speculative"],
                   help="none: plain decoding; dflash: parallel backbone, fixed gamma; "
                        "dspark: full DSpark; ngram: prompt lookup alone; hybrid: prompt "
                        "lookup where the text repeats, DSpark elsewhere, one scheduled pool "
                        "(default: %(default)s)")
    p.add_argument("--scheduler", choices=SCHEDULER_NAMES, default=_DEFAULTS["scheduler"],
                   help="verify-length scheduler (default: %(default)s)")
    p.add_argument("--gamma", type=int, help="draft tokens per round (a smaller gamma drafts "
                   "with the block cut to its first gamma positions: cheaper); default: the "
                   "drafter's block")
    p.add_argument("--threshold", type=float, default=_DEFAULTS["threshold"],
                   help="survival cut-off of the threshold scheduler (default: %(default)s)")
    p.add_argument("--cost-table", help="SPS cost table JSON; default: profile at startup")
    p.add_argument("--calibration", help="STS calibration JSON; default: the drafter's")
    p.add_argument("--lookup-calibration",
                   help="prompt-lookup survival JSON (ngram, hybrid); default: the target's")
    p.add_argument("--corpus",
                   help="hybrid: corpus lookup beside prompt lookup, from a `dspark-serve corpus` "
                        "folder or 'shipped' (the target's); default: off")
    p.add_argument("--lookup-min-match", type=int, default=_DEFAULTS["lookup_min_match"],
                   help="hybrid: shortest suffix match prompt lookup may draft with; longer "
                        "matches are lookup's where expected to get more drafts accepted than "
                        "the drafter (default: %(default)s)")
    p.add_argument("--draft-vocab-size", type=int,
                   help="prune the drafter's draft vocabulary to the N most frequent tokens of "
                        "its token ranking at load; 0 keeps its own (default: 8192 where the "
                        "drafter ships a ranking, as the default DSpark drafter does)")
    p.add_argument("--max-model-len", type=int, default=_DEFAULTS["max_model_len"],
                   help="context limit per request in tokens (default: the model's "
                        "max_position_embeddings, 8192 for the default model)")
    p.add_argument("--max-num-seqs", type=int, default=_DEFAULTS["max_num_seqs"],
                   help="most requests per step (default: %(default)s)")
    p.add_argument("--kv-cache-tokens", type=int, default=_DEFAULTS["kv_cache_tokens"],
                   help="KV cache size in token positions: one pool of 64-token pages shared "
                        "by all requests, which wait for free pages; at least --max-model-len "
                        f"(default: {POOL_TOKENS_PER_SEQ} per --max-num-seqs, at least "
                        "--max-model-len; 22.5 KiB per token on the default model)")
    p.add_argument("--dtype", choices=DTYPES, default=_DEFAULTS["dtype"],
                   help="weight dtype (default: %(default)s)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=_DEFAULTS["quantization"],
                   help="int4: 4-bit target weights (GGUF Q4_1 layout), faster decoding at "
                        "low concurrency on a CPU (default: %(default)s)")
    p.add_argument("--always-draft", action="store_true",
                   help="draft every step, even where the async scheduler measures drafting "
                        "to cost more than it brings (default: skip those drafts)")
    p.add_argument("--no-mask-drafts", dest="mask_drafts", action="store_false",
                   help="structured outputs: verify drafts as drafted instead of restricting "
                        "them to the grammar first (both exact; masking accepts more)")
    p.add_argument("--seed", type=int, default=_DEFAULTS["seed"],
                   help="engine RNG seed (default: %(default)s)")
    p.add_argument("--threads", type=int,
                   help="CPU threads of the engine's tensor ops (default: one per core but "
                        "one, which is left to the HTTP event loop; OMP_NUM_THREADS, if set)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="log level (default: %(default)s)")
    p.add_argument("--backend", choices=BACKENDS, default="embedded",
                   help="embedded: this package's engine (CPU or GPU); sglang: SGLang 0.5.23 "
                        "with the DSPARK_SERVE plugin, needs a GPU and "
                        "pip install 'dspark-serve[sglang]' (default: %(default)s)")
    p.add_argument("sglang_args", nargs="*", metavar="SGLANG_FLAGS",
                   help="with --backend sglang: any other flags (e.g. --tp-size 2) go to "
                        "SGLang's server unchanged, as do flags after --")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of parsed ``serve`` flags; raises ValueError on invalid values."""
    return EngineConfig(
        model=args.model, draft=args.draft, speculative=args.speculative,
        scheduler=args.scheduler, gamma=args.gamma, cost_table=args.cost_table,
        calibration=args.calibration, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, kv_cache_tokens=args.kv_cache_tokens, seed=args.seed,
        dtype=args.dtype,
        quantization=args.quantization, always_draft=args.always_draft,
        threshold=args.threshold, lookup_calibration=args.lookup_calibration,
        lookup_min_match=args.lookup_min_match, corpus=args.corpus,
        draft_vocab_size=args.draft_vocab_size,
        mask_drafts=args.mask_drafts)


def run(args: argparse.Namespace) -> int:
    """Build the engine, then serve until interrupted; returns the exit code."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.backend == "sglang":
        from dspark_serve.sglang_plugin.launch import run as run_sglang

        try:
            return run_sglang(args)
        except ValueError as exc:
            logging.getLogger(__name__).error("invalid configuration: %s", exc)
            return 2
    if args.sglang_args:
        logging.getLogger(__name__).error("extra arguments %s are only for --backend sglang",
                                          args.sglang_args)
        return 2
    try:
        config = config_from_args(args)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
    except ValueError as exc:
        logging.getLogger(__name__).error("invalid configuration: %s", exc)
        return 2
    import torch
    import uvicorn

    torch.set_num_threads(serving_threads(args.threads, torch.get_num_threads()))

    from dspark_serve.engine.llm_engine import LLMEngine
    from dspark_serve.server.app import create_app

    engine = LLMEngine(config)
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def serving_threads(requested: int | None, available: int) -> int:
    """Engine threads: ``requested``, else ``available`` (torch's default: one per core, or
    OMP_NUM_THREADS) less one core for the event loop that streams every token (measured on
    2 cores, plain decoding over HTTP: 59 tok/s with one engine thread, 35 with two)."""
    if requested is not None:
        return requested
    if "OMP_NUM_THREADS" in os.environ:
        return available
    return max(1, available - 1)
