"""Logit warping: temperature, top-k, top-p and min-p, turned into the explicit probability
vector that both the drafter and the target sample from.

Speculative decoding is lossless only if draft and target tokens are accepted against the
*warped* distributions (paper Section 2.1; Leviathan et al. 2023), so the verifier needs the
full vectors rather than a sampled token; this module produces them.
"""
from __future__ import annotations

import torch

from dspark_serve.sampling.argmax import row_argmax
from dspark_serve.types import SamplingTensors

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
GREEDY_TEMPERATURE = 1e-5
# Partial top-m sizes tried when locating the top-p cutoff (grown geometrically).
_FIRST_CANDIDATES = 64
_CANDIDATE_GROWTH = 8


def warp_probs(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Warped next-token distributions, one per row.

    Steps: divide by the temperature, softmax, then keep the tokens that pass *all* of
    top-k (the k most likely), top-p (the smallest set of most likely tokens whose
    cumulative probability reaches p) and min-p (probability >= min_p * max probability),
    each judged on the post-temperature probabilities, and renormalise. Because every
    filter reads the same post-temperature vector the result does not depend on their
    order; this is SGLang's convention (vLLM instead renormalises after top-k before
    applying top-p). Each filter is a probability cutoff, so tokens tied with the last kept
    one are kept too, and the most likely token always survives. Rows with temperature
    < ``GREEDY_TEMPERATURE`` become a one-hot vector at the argmax of the logits (the first
    maximum on ties); greedy decoding is this special case.

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
    greedy = params.temperature < GREEDY_TEMPERATURE
    one_hot = None
    if bool(greedy.any()):
        one_hot = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        one_hot.scatter_(1, row_argmax(logits)[:, None], 1.0)
        if bool(greedy.all()):
            return one_hot
    temperature = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)

    cutoff = _top_k_top_p_cutoff(probs, params.top_k, params.top_p)
    if bool((params.min_p > 0).any()):
        min_p_cutoff = params.min_p * probs.amax(dim=-1)
        cutoff = min_p_cutoff if cutoff is None else torch.maximum(cutoff, min_p_cutoff)
    if cutoff is not None:
        probs = torch.where(probs >= cutoff[:, None], probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if one_hot is not None:
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _top_k_top_p_cutoff(probs: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor) -> torch.Tensor | None:
    """[N] smallest probability kept by top-k and top-p (0 where both are off), or None
    when no row uses either."""
    vocab = probs.shape[1]
    top_k_on = (top_k > 0) & (top_k < vocab)
    top_p_on = top_p < 1.0
    if not bool(top_k_on.any() | top_p_on.any()):
        return None
    # A full sort of a large vocabulary costs far more than the forward pass on a CPU; the
    # nucleus is usually small, so grow a partial top-m until it holds mass p in every row.
    m = max(int(top_k[top_k_on].max()) if bool(top_k_on.any()) else 1, _FIRST_CANDIDATES)
    while True:
        m = min(m, vocab)
        values = probs.topk(m, dim=-1, sorted=True).values                 # [N, m]
        mass = values.cumsum(dim=-1)
        if m == vocab or bool((~top_p_on | (mass[:, -1] >= top_p)).all()):
            break
        m *= _CANDIDATE_GROWTH
    k_index = torch.where(top_k_on, top_k, 1) - 1
    k_cutoff = torch.where(top_k_on, values.gather(1, k_index[:, None]).squeeze(1), 0.0)
    # Tokens whose preceding mass is still below p form the smallest prefix reaching p.
    in_nucleus = ((mass - values) < top_p[:, None]).sum(dim=-1).clamp(min=1)
    p_cutoff = torch.where(top_p_on, values.gather(1, (in_nucleus - 1)[:, None]).squeeze(1), 0.0)
    return torch.maximum(k_cutoff, p_cutoff)


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
