"""Where SGLang 0.5.23's DSPARK verify path misses a sampling parameter, and our correction.

- min-p: SGLang's verify accept (``dspark_verify.accept_draft_tokens`` -> ``AcceptSampling`` /
  ``BlockwiseRejection``) warps the target with temperature, top-k and top-p but never min-p,
  so min-p requests are sampled from the wrong target distribution. ``min_p_masked_logits``
  removes the tokens min-p forbids from the target logits (-inf), using our ``warp_probs``
  (temperature, then min-p on the post-temperature probabilities), so any sampler that applies
  temperature afterwards sees exactly the min-p-renormalised target.
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


def draft_caps(gamma: int, has_penalty: torch.Tensor) -> torch.Tensor:
    """[R] int64 most draft tokens each request may verify: 0 for penalised requests
    (``has_penalty`` [R] bool), else gamma."""
    if has_penalty.dtype != torch.bool or has_penalty.ndim != 1:
        raise ValueError(f"has_penalty must be a 1-D bool tensor, got {has_penalty.dtype} "
                         f"{tuple(has_penalty.shape)}")
    return torch.where(has_penalty, 0, gamma).to(torch.int64)
