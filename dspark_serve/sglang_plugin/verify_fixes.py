"""Where SGLang 0.5.23's DSPARK verify path misses a sampling parameter, and our correction.

- min-p: SGLang's verify accept (``dspark_verify.accept_draft_tokens`` -> ``AcceptSampling`` /
  ``BlockwiseRejection``) warps the target with temperature, top-k and top-p but never min-p,
  so min-p requests are sampled from the wrong target distribution. ``min_p_target_logits``
  removes the tokens min-p forbids from the verify logits (-inf), using our ``warp_probs``
  (temperature, then min-p on the post-temperature probabilities), so SGLang's accept, which
  applies temperature, top-k and top-p afterwards, sees exactly the min-p target: a forbidden
  draft has target probability 0 and is always rejected, and the recovered/bonus token never
  is one. Min-p's kept set {p >= min_p * max p} is the same before or after top-k/top-p
  renormalisation, so the order matches SGLang's non-speculative sampler. The worker applies
  it (``worker.DSparkServeVerifyExecutor``).
- penalties: SGLang adds one penalty row per request to every block position, so a drafted
  token does not penalise the positions after it. ``draft_caps`` gives such requests no draft
  positions (l_r = 0): the single verified token is then sampled exactly as without
  speculation. Lossless, at the cost of no speedup for those requests.
"""
from __future__ import annotations

import torch

from dspark_serve.sampling.warping import warp_probs
from dspark_serve.types import SamplingTensors


def min_p_masked_logits(logits: torch.Tensor, temperature: torch.Tensor,
                        min_p: torch.Tensor) -> torch.Tensor:
    """Target logits with the tokens min-p removes set to -inf (rows with min_p 0 unchanged).

    Args:
        logits: [N, V] float target logits.
        temperature: [N] float32 (0 = greedy: the argmax is kept, min-p never removes it).
        min_p: [N] float32 in [0, 1].
    Returns:
        [N, V] logits, same dtype and device.
    Raises:
        ValueError: shape mismatch or out-of-range values (``warp_probs`` checks).
    """
    n = logits.shape[0]
    params = SamplingTensors(temperature.float(), torch.zeros(n, dtype=torch.int64, device=logits.device),
                             torch.ones(n, dtype=torch.float32, device=logits.device), min_p.float())
    kept = warp_probs(logits, params) > 0
    active = (min_p > 0) & (temperature > 0)
    return torch.where(active[:, None] & ~kept, torch.full_like(logits, float("-inf")), logits)


def min_p_target_logits(target_logits: torch.Tensor, temperatures: torch.Tensor,
                        min_ps: torch.Tensor, rows_per_request: int) -> torch.Tensor:
    """``min_p_masked_logits`` on SGLang's verify logits, one block of rows per request.

    Args:
        target_logits: [R * rows_per_request, V] float verify logits (SGLang's strided
            ``next_token_logits``: request r owns rows r*n .. r*n + n-1).
        temperatures: [R] or [R, 1] float32 (SGLang's ``sampling_info.temperatures``).
        min_ps: [R] float32 in [0, 1] (``sampling_info.min_ps``).
        rows_per_request: n = verify_num_draft_tokens (gamma + 1).
    Returns:
        [R * n, V] logits, same dtype and device.
    Raises:
        ValueError: shapes that do not match R requests of n rows.
    """
    num_req = min_ps.shape[0]
    if (target_logits.ndim != 2 or min_ps.ndim != 1 or rows_per_request < 1
            or target_logits.shape[0] != num_req * rows_per_request
            or temperatures.numel() != num_req):
        raise ValueError(f"target_logits [R * {rows_per_request}, V] with R = {num_req} "
                         f"requests expected, got {tuple(target_logits.shape)} (temperatures "
                         f"{tuple(temperatures.shape)}, min_ps {tuple(min_ps.shape)})")
    temp_rows = temperatures.reshape(-1).float().repeat_interleave(rows_per_request)
    min_p_rows = min_ps.float().repeat_interleave(rows_per_request)
    return min_p_masked_logits(target_logits, temp_rows, min_p_rows)


def draft_caps(gamma: int, has_penalty: torch.Tensor) -> torch.Tensor:
    """[R] int64 most draft tokens each request may verify: 0 for penalised requests
    (``has_penalty`` [R] bool), else gamma."""
    if has_penalty.dtype != torch.bool or has_penalty.ndim != 1:
        raise ValueError(f"has_penalty must be a 1-D bool tensor, got {has_penalty.dtype} "
                         f"{tuple(has_penalty.shape)}")
    return torch.where(has_penalty, 0, gamma).to(torch.int64)
