"""Logit warping: temperature, top-k, top-p and min-p, turned into the explicit probability
vector that both the drafter and the target sample from.

Speculative decoding is lossless only if draft and target tokens are accepted against the
*warped* distributions (paper Section 2.1; Leviathan et al. 2023), so the verifier needs the
full vectors rather than a sampled token; this module produces them.
"""
from __future__ import annotations

import torch

from dspark_serve.types import SamplingTensors

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
GREEDY_TEMPERATURE = 1e-5


def warp_probs(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Warped next-token distributions, one per row.

    Steps: divide by the temperature, softmax, then keep the tokens that pass *all* of
    top-k (the k most likely), top-p (the smallest set of most likely tokens whose
    cumulative probability reaches p) and min-p (probability >= min_p * max probability),
    each judged on the post-temperature probabilities, and renormalise. Because every
    filter reads the same post-temperature vector the result does not depend on their
    order; this is SGLang's convention (vLLM instead renormalises after top-k before
    applying top-p). The most likely token always survives. Ties at a top-k/top-p boundary
    go to the lower token id. Rows with temperature < ``GREEDY_TEMPERATURE`` become a
    one-hot vector at the argmax of the logits (greedy decoding is this special case).

    Args:
        logits: [N, V] floating point.
        params: ``SamplingTensors`` with N rows on the same device as ``logits``;
            top_k 0 or >= V, top_p 1.0 and min_p 0.0 disable the respective filter.

    Returns:
        [N, V] float32, rows sum to 1 and are zero outside the kept set.

    Raises:
        ValueError: wrong shapes, dtypes or devices, temperature < 0, top_k < 0,
            top_p outside (0, 1], or min_p outside [0, 1].
    """
    _check(logits, params)
    n, vocab = logits.shape
    greedy = params.temperature < GREEDY_TEMPERATURE
    temperature = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)

    keep = _top_k_top_p_mask(probs, params.top_k, params.top_p)
    if bool((params.min_p > 0).any()):
        min_keep = probs >= params.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        keep = min_keep if keep is None else keep & min_keep
    if keep is not None:
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)

    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _top_k_top_p_mask(probs: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor | None:
    """Bool [N, V] of tokens kept by top-k and top-p, or None when no row uses either."""
    n, vocab = probs.shape
    k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
    top_p_on = top_p < 1.0
    if not bool(top_p_on.any() | (k < vocab).any()):
        return None
    # A full sort even for top-k only: ties then resolve the same way on every path.
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)
    keep_sorted = rank[None, :] < k[:, None]
    # Mass strictly before a token; it is kept while that mass is still below p, which
    # selects the smallest prefix reaching p (rank 0 has zero mass before it).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted &= (mass_before < top_p[:, None]) | ~top_p_on[:, None] | (rank[None, :] == 0)
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def _check(logits: torch.Tensor, params: SamplingTensors) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating [N, V] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    n = logits.shape[0]
    for name, dtype in (("temperature", torch.float32), ("top_k", torch.int64),
                        ("top_p", torch.float32), ("min_p", torch.float32)):
        t = getattr(params, name)
        if t.shape != (n,) or t.dtype != dtype or t.device != logits.device:
            raise ValueError(f"params.{name} must be {dtype} [{n}] on {logits.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    bad = torch.stack([(params.temperature < 0).any(), (params.top_k < 0).any(),
                       ((params.top_p <= 0) | (params.top_p > 1)).any(),
                       ((params.min_p < 0) | (params.min_p > 1)).any()]).tolist()
    for flag, what in zip(bad, ("temperature must be >= 0", "top_k must be >= 0",
                                "top_p must be in (0, 1]", "min_p must be in [0, 1]")):
        if flag:
            raise ValueError(what)
