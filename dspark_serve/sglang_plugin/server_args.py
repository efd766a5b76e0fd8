"""Server-arg validation for ``--speculative-algorithm DSPARK_SERVE`` (SGLang calls it with its
``ServerArgs`` through ``SpeculativeAlgorithm.register(validate_server_args=...)``).

Plain attribute reads, so it also runs on a namespace in tests. Every rejection is a ValueError
naming the flag to fix.
"""
from __future__ import annotations

from pathlib import Path

from dspark_serve.calibration.io import load_sts_calibration
from dspark_serve.drafter.checkpoint import CONFIG_FILE
from dspark_serve.scheduling.cost_table import CostTable
from dspark_serve.sglang_plugin.model import check_drafter_config


def validate_server_args(server_args, *, cuda_available: bool | None = None) -> None:
    """Check a DSPARK_SERVE configuration before any model loads.

    Reads ``device``, ``speculative_draft_model_path``, ``speculative_num_draft_tokens``,
    ``speculative_dspark_sps_table_path``, ``speculative_dspark_confidence_sts_path``.
    ``cuda_available`` defaults to ``torch.cuda.is_available()``.
    Raises:
        ValueError: no GPU / non-CUDA device, missing or unreadable draft folder, a block size
            (``--speculative-num-draft-tokens``) other than the drafter's gamma + 1, a missing
            or invalid cost table, an invalid STS file or one of another gamma.
    """
    import json

    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    device = str(getattr(server_args, "device", None) or "cuda")
    if not device.startswith("cuda") or not cuda_available:
        raise ValueError(f"DSPARK_SERVE needs a CUDA GPU (device {device!r}, CUDA available: "
                         f"{cuda_available}); without one use `dspark-serve serve --backend "
                         f"embedded`")
    draft = getattr(server_args, "speculative_draft_model_path", None)
    if not draft:
        raise ValueError("DSPARK_SERVE needs --speculative-draft-model-path (a DeepSpec DSpark "
                         "drafter folder)")
    config_file = Path(draft) / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"--speculative-draft-model-path {draft!r} has no {CONFIG_FILE}")
    config = check_drafter_config(json.loads(config_file.read_text(encoding="utf-8")))
    tokens = getattr(server_args, "speculative_num_draft_tokens", None)
    if tokens is not None and tokens != config.gamma + 1:
        raise ValueError(f"--speculative-num-draft-tokens {tokens} does not match the drafter: "
                         f"block size {config.block_size} gives gamma {config.gamma}, so use "
                         f"{config.gamma + 1} (gamma drafts + 1)")
    table = getattr(server_args, "speculative_dspark_sps_table_path", None)
    if not table:
        raise ValueError("DSPARK_SERVE needs --speculative-dspark-sps-table-path (SPS cost "
                         "table JSON, e.g. from `dspark-serve profile`): the asynchronous "
                         "scheduler optimises Theta = tau * SPS(B)")
    CostTable.load(table)
    sts = getattr(server_args, "speculative_dspark_confidence_sts_path", None)
    if sts:
        temps = load_sts_calibration(sts).temperatures
        if len(temps) != config.gamma:
            raise ValueError(f"--speculative-dspark-confidence-sts-path has {len(temps)} "
                             f"temperatures, the drafter's gamma is {config.gamma}")
