"""Seeded requests sample in *replay* form.

The token at output index i of a request with a seed is the inverse-CDF sample of the target
distribution with the uniform ``seeded_uniform(seed, i)``; speculation then only decides how
many of those tokens one forward confirms (a draft is accepted iff it equals the target's
sample, the first mismatch emits the target's sample). That is still exact sampling from the
target, and the output is identical to non-speculative decoding with the same seed, whatever
the batch, the scheduler or the drafter; the price is a lower acceptance rate than rejection
sampling (sum p_t p_d instead of sum min(p_t, p_d)).
"""
from __future__ import annotations

import torch

from dspark_serve.sampling.sampler import sample_from_probs

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a well-spread 64-bit hash of (seed, index) pairs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, index: int) -> float:
    """The uniform in [0, 1) that decides output token ``index`` of a request with ``seed``
    (24 random bits, exact in float32, independent of everything else the engine does)."""
    return (_mix64(_mix64(seed & _MASK64) ^ index) >> 40) / float(1 << 24)


def replay_seeded(target_probs: torch.Tensor, seeds: list[int | None], num_output: list[int],
                  lengths: list[int]) -> torch.Tensor:
    """Turn seeded rows' target distributions into one-hot replay samples (module doc).

    Args:
        target_probs: [R, gamma + 1, V] float32 warped target distributions; row r uses
            positions 0..lengths[r].
        seeds: [R] each row's seed, None for unseeded rows (left as they are).
        num_output: [R] output tokens each row had committed before this round.
        lengths: [R] verified draft lengths l_r.
    Returns:
        target_probs with the used positions of seeded rows replaced by one-hot samples
        (modified in place and returned).
    """
    rows, cols, us = [], [], []
    for i, seed in enumerate(seeds):
        if seed is None:
            continue
        for j in range(lengths[i] + 1):
            rows.append(i)
            cols.append(j)
            us.append(seeded_uniform(seed, num_output[i] + j))
    if rows:
        ri = torch.tensor(rows, device=target_probs.device)
        ci = torch.tensor(cols, device=target_probs.device)
        u = torch.tensor(us, dtype=torch.float32, device=target_probs.device)
        tokens = sample_from_probs(target_probs[ri, ci], u)
        target_probs[ri, ci] = 0.0
        target_probs[ri, ci, tokens] = 1.0
    return target_probs
