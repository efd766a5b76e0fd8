"""Inverse-CDF sampling from explicit probability vectors with caller-supplied uniforms.

Drawing the uniforms separately from using them lets each request own a seeded stream
(reproducible regardless of batch composition) and lets tests replay exact choices.
"""
from __future__ import annotations

from typing import Sequence

import torch


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse CDF: the first token whose cumulative mass exceeds
    ``u * total``.

    The weights need not be normalised (the verifier passes the unnormalised residual
    max(0, p_t - p_d)). A zero-probability token is never returned, even for ``u`` close
    to 1 where float rounding of the cumulative sum would otherwise step past the last
    token with mass.

    Args:
        probs: [N, V] float32, non-negative, every row with positive finite total mass.
        uniforms: [N] float32 in [0, 1) on the same device.

    Returns:
        [N] int64 token ids.

    Raises:
        ValueError: wrong shapes, dtypes or devices, or a row without positive finite mass.
    """
    if probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError(f"probs must be float32 [N, V], got {probs.dtype} {tuple(probs.shape)}")
    if uniforms.shape != probs.shape[:1] or uniforms.dtype != torch.float32 \
            or uniforms.device != probs.device:
        raise ValueError(f"uniforms must be float32 [{probs.shape[0]}] on {probs.device}, got "
                         f"{uniforms.dtype} {tuple(uniforms.shape)} on {uniforms.device}")
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise ValueError("every row of probs needs positive, finite total mass")
    # Zero-mass tokens repeat the previous cdf value, so "first cdf > target" skips them.
    target = (uniforms * total).unsqueeze(-1)
    token = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # u * total may round up to total; fall back to the last token that has mass.
    vocab_ids = torch.arange(probs.shape[1], device=probs.device)
    last_with_mass = torch.where(probs > 0, vocab_ids, 0).amax(dim=-1)
    return torch.minimum(token, last_with_mass)


def draw_uniforms(generators: Sequence[torch.Generator | None], n: int,
                  device: torch.device | str) -> torch.Tensor:
    """``n`` uniforms in [0, 1) per request from that request's generator.

    Args:
        generators: R entries; a ``torch.Generator`` (on ``device``) gives a seeded stream
            that advances by exactly ``n`` draws per call, ``None`` uses the global RNG.
        n: uniforms per request, >= 0.
        device: where the result lives.

    Returns:
        [R, n] float32.

    Raises:
        ValueError: negative ``n`` or a generator on another device type.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    device = torch.device(device)
    out = torch.empty((len(generators), n), dtype=torch.float32, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        out[unseeded] = torch.rand((len(unseeded), n), device=device)
    for i, g in enumerate(generators):
        if g is None:
            continue
        if g.device.type != device.type:
            raise ValueError(f"generator {i} is on {g.device}, uniforms requested on {device}")
        out[i] = torch.rand(n, generator=g, device=device)
    return out
