"""``dspark-serve serve --backend sglang``: start SGLang's HTTP server with the plugin.

``build_sglang_argv`` turns our ``serve`` flags into ``sglang.launch_server`` flags (pure, tested
without SGLang); ``run`` execs ``python -m sglang.launch_server``, whose ``load_plugins()`` finds
our ``sglang.srt.plugins`` entry point. Flags ``serve`` does not know (``dspark_serve.cli``
moves them behind ``--``) and flags after ``--`` go to SGLang unchanged and last, so they
override ours (SGLang's argparse keeps the last value).
"""
from __future__ import annotations

import argparse
import os
import sys

from dspark_serve.assets.default_drafter import SGLANG_DRAFTER_KIND, shipped_drafter_path
from dspark_serve.assets.default_model import MODEL_NAME, default_model_path
from dspark_serve.sglang_plugin import ALGORITHM_NAME

# SGLang's per-request verify lengths (RaggedVerifyLayout) need a non-static ragged mode;
# "compact" packs only the scheduled tokens into the verify forward.
RAGGED_VERIFY_ENV = {"SGLANG_RAGGED_VERIFY_MODE": "compact"}


def build_sglang_argv(args: argparse.Namespace, model_path: str,
                      draft_path: str | None) -> list[str]:
    """``sglang.launch_server`` arguments for parsed ``serve`` flags.

    Args:
        args: the ``serve`` namespace (model, speculative, scheduler, gamma, cost_table,
            calibration, max_model_len, kv_cache_tokens, max_num_seqs, dtype, seed, host,
            port, log_level, sglang_args).
        model_path: target folder (``args.model`` or the default model, resolved by the caller).
        draft_path: drafter folder (needed unless speculative is "none").
    Raises:
        ValueError: a combination SGLang cannot serve with this plugin.
    """
    if args.speculative in ("dflash", "ngram"):
        raise ValueError("--backend sglang serves --speculative dspark (hybrid, the default, "
                         "is served as dspark) or none; for DFlash or prompt lookup use "
                         "SGLang's own --speculative-algorithm DFLASH / NGRAM after --")
    # SGLang has no hybrid proposer: its drafter half is DSPARK_SERVE
    speculative = "dspark" if args.speculative == "hybrid" else args.speculative
    if speculative == "dspark" and args.scheduler != "async":
        raise ValueError(f"--backend sglang runs the asynchronous scheduler only (SGLang's "
                         f"overlap scheduler), got --scheduler {args.scheduler}")
    argv = ["--model-path", model_path, "--host", args.host, "--port", str(args.port),
            "--dtype", args.dtype]
    # Unset: SGLang's defaults, the model's context and a pool sized from GPU memory.
    if args.max_model_len is not None:
        argv += ["--context-length", str(args.max_model_len)]
    if args.kv_cache_tokens is not None:
        argv += ["--max-total-tokens", str(args.kv_cache_tokens)]
    argv += ["--max-running-requests", str(args.max_num_seqs),
             "--random-seed", str(args.seed), "--log-level", args.log_level]
    if speculative == "dspark":
        if not draft_path:
            raise ValueError("--backend sglang with --speculative dspark needs --draft (no "
                             "shipped drafter for this model)")
        if not args.cost_table:
            raise ValueError("--backend sglang with --speculative dspark needs --cost-table "
                             "(profile it on the GPU with `dspark-serve profile`)")
        argv += ["--speculative-algorithm", ALGORITHM_NAME,
                 "--speculative-draft-model-path", draft_path,
                 "--speculative-dspark-sps-table-path", args.cost_table]
        if args.gamma is not None:
            argv += ["--speculative-num-draft-tokens", str(args.gamma + 1)]
        if args.calibration:
            argv += ["--speculative-dspark-confidence-sts-path", args.calibration]
    return argv + list(getattr(args, "sglang_args", None) or [])


def run(args: argparse.Namespace) -> int:
    """Resolve the model/drafter paths, then replace this process with SGLang's server."""
    from pathlib import Path

    model_path = args.model or default_model_path()
    name = Path(model_path).name if args.model else MODEL_NAME
    draft = args.draft or shipped_drafter_path(name, SGLANG_DRAFTER_KIND)
    argv = build_sglang_argv(args, model_path, None if draft is None else str(draft))
    env = {**os.environ, **{k: v for k, v in RAGGED_VERIFY_ENV.items() if k not in os.environ}}
    os.execvpe(sys.executable, [sys.executable, "-m", "sglang.launch_server", *argv], env)
    return 0    # not reached
