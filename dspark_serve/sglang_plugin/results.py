"""Per-request verify outcomes as the fields of SGLang's ``GenerationBatchResult``.

SGLang's output processor (``managers/scheduler_components/batch_result_processor.py``,
``_resolve_spec_v2_tokens``) derives ``num_correct_drafts`` = sum(accept_lens - 1) and
``num_cap_tokens`` = sum(cap_lens) from the worker's tensors, and /metrics and /server_info
report acceptance from them, so a worker only has to fill these tensors correctly.
"""
from __future__ import annotations

import torch

from dspark_serve.types import VerifyResult


def batch_result_fields(result: VerifyResult, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """Map one verify round onto ``GenerationBatchResult`` keyword arguments.

    Args:
        result: ``VerifyResult`` of R requests (num_accepted tau_r, tokens [R, gamma+1] padded -1).
        lengths: [R] int64 scheduled draft lengths l_r (0..gamma).
    Returns:
        ``next_token_ids`` [R * (gamma+1)] int64 (padded rows, -1 after each request's tokens),
        ``accept_lens`` [R] int32 tokens committed (tau_r + 1: accepted drafts + the bonus or
        recovered token), ``cap_lens`` [R] int32 verified positions (l_r + 1).
    Raises:
        ValueError: mismatched shapes, or num_accepted outside 0..l_r.
    """
    num_req = result.num_accepted.shape[0]
    if lengths.shape != (num_req,) or result.tokens.ndim != 2 or result.tokens.shape[0] != num_req:
        raise ValueError(f"lengths [{num_req}] and tokens [{num_req}, gamma+1] expected, got "
                         f"{tuple(lengths.shape)} and {tuple(result.tokens.shape)}")
    if bool(((result.num_accepted < 0) | (result.num_accepted > lengths)).any()):
        raise ValueError("num_accepted must lie in 0..l_r for every request")
    return {
        "next_token_ids": result.tokens.reshape(-1).to(torch.int64),
        "accept_lens": (result.num_accepted + 1).to(torch.int32),
        "cap_lens": (lengths + 1).to(torch.int32),
    }
