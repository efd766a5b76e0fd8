"""Per-request Philox4x32-10 uniform streams (Salmon et al. 2011), bit-identical on CPU
(this file) and GPU (``csrc/philox.cuh``), so a seeded request draws the same draft tokens
wherever it runs and tests can replay the kernel's random choices.

Definition: u[r, i] = (word_{i mod 4} >> 8) * 2^-24 of philox(counter, key) with
counter = (lo32(c), hi32(c), 0, 0), c = offset[r] + i // 4, key = (lo32(seed[r]),
hi32(seed[r])). A request consuming n uniforms per step advances its offset by ceil(n / 4).
"""
from __future__ import annotations

import torch

from dspark_serve.ops.extension import use_cuda_kernel

_MASK32 = 0xFFFFFFFF
_MUL = (0xD2511F53, 0xCD9E8D57)
_BUMP = (0x9E3779B9, 0xBB67AE85)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b for a 32-bit constant and int64 tensor b < 2^32,
    computed in 16-bit halves so nothing exceeds 2^49 in int64."""
    p_lo = (a & 0xFFFF) * b
    p_hi = (a >> 16) * b
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    return hi & _MASK32, lo


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 block function.

    Args:
        counter: [N, 4] int64 holding uint32 values.
        key: [N, 2] int64 holding uint32 values.

    Returns:
        [N, 4] int64 holding the uint32 output words.
    """
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    for _ in range(10):
        hi0, lo0 = _mulhilo(_MUL[0], c0)
        hi1, lo1 = _mulhilo(_MUL[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _BUMP[0]) & _MASK32, (k1 + _BUMP[1]) & _MASK32
    return torch.stack([c0, c1, c2, c3], dim=-1)


def philox_uniforms(seed: torch.Tensor, offset: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` uniforms per request from its (seed, offset) Philox stream.

    Args:
        seed: [R] int64 per-request seed (all 64 bits used).
        offset: [R] int64 counter offset, in blocks of 4 uniforms.
        n: uniforms per request, >= 0.

    Returns:
        [R, n] float32 in [0, 1) on seed's device (the CUDA kernel for CUDA tensors).

    Raises:
        ValueError: wrong shapes, dtypes or devices, or negative n.
    """
    if seed.dim() != 1 or seed.dtype != torch.int64 or offset.shape != seed.shape \
            or offset.dtype != torch.int64 or offset.device != seed.device:
        raise ValueError(f"seed and offset must be int64 [R] on one device, got {seed.dtype} "
                         f"{tuple(seed.shape)} and {offset.dtype} {tuple(offset.shape)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if use_cuda_kernel(seed):
        out = torch.empty((seed.numel(), n), dtype=torch.float32, device=seed.device)
        torch.ops.dspark.philox_uniforms(seed.contiguous(), offset.contiguous(), out)
        return out
    i = torch.arange(n, device=seed.device)
    c = offset[:, None] + torch.div(i, 4, rounding_mode="floor")              # [R, n]
    s = seed[:, None].expand_as(c)
    counter = torch.stack([c & _MASK32, (c >> 32) & _MASK32, torch.zeros_like(c),
                           torch.zeros_like(c)], dim=-1).view(-1, 4)
    key = torch.stack([s & _MASK32, (s >> 32) & _MASK32], dim=-1).view(-1, 2)
    words = philox4x32_10(counter, key).view(*c.shape, 4)
    word = words.gather(-1, (i % 4).expand_as(c)[..., None]).squeeze(-1)
    return (word >> 8).to(torch.float32) * (1.0 / 16777216.0)
