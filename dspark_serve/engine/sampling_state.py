"""Per-step sampling inputs built from the running requests: warping parameters, penalty state
and random numbers.

Randomness. Requests without a seed draw from the engine's generator. A seeded request is
sampled in *replay* form: the token at output index i is the inverse-CDF sample of the
target distribution with the uniform ``seeded_uniform(seed, i)``; speculation then only decides
how many of those tokens one forward confirms (a draft is accepted iff it equals the target's
sample, the first mismatch emits the target's sample). That is still exact sampling from the
target, and the output is identical to non-speculative decoding with the same seed, whatever
the batch, the scheduler or the drafter; the price is a lower acceptance rate than rejection
sampling (sum p_t p_d instead of sum min(p_t, p_d)).
"""
from __future__ import annotations

import torch

from dspark_serve.engine.penalties import PenaltyState
from dspark_serve.engine.request import Request
from dspark_serve.sampling.sampler import sample_from_probs
from dspark_serve.types import SamplingTensors

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


def sampling_tensors(requests: list[Request], device: torch.device) -> SamplingTensors:
    """[R] warping parameters of the requests, in order."""
    p = [r.params for r in requests]
    return SamplingTensors(
        temperature=torch.tensor([x.temperature for x in p], dtype=torch.float32, device=device),
        top_k=torch.tensor([x.top_k for x in p], dtype=torch.int64, device=device),
        top_p=torch.tensor([x.top_p for x in p], dtype=torch.float32, device=device),
        min_p=torch.tensor([x.min_p for x in p], dtype=torch.float32, device=device))


def uses_penalties(request: Request) -> bool:
    p = request.params
    return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0
                or p.logit_bias)


def penalty_state(requests: list[Request], vocab_size: int,
                  device: torch.device) -> PenaltyState | None:
    """Penalty inputs for the requests ([R, V] rows), or None when none of them has any."""
    if not any(uses_penalties(r) for r in requests):
        return None
    R = len(requests)
    counts = torch.zeros(R, vocab_size, dtype=torch.float32, device=device)
    prompt_mask = torch.zeros(R, vocab_size, dtype=torch.bool, device=device)
    bias = None
    for i, r in enumerate(requests):
        if not uses_penalties(r):
            continue
        if r.output_ids:
            out = torch.tensor(r.output_ids, dtype=torch.int64, device=device)
            counts[i].index_add_(0, out, torch.ones(out.numel(), device=device))
        prompt_mask[i, torch.tensor(r.prompt_ids, dtype=torch.int64, device=device)] = True
        if r.params.logit_bias:
            if bias is None:
                bias = torch.zeros(R, vocab_size, dtype=torch.float32, device=device)
            ids = torch.tensor(list(r.params.logit_bias), dtype=torch.int64, device=device)
            bias[i, ids] = torch.tensor(list(r.params.logit_bias.values()), dtype=torch.float32,
                                        device=device)
    f = lambda name: torch.tensor([getattr(r.params, name) for r in requests],
                                  dtype=torch.float32, device=device)
    return PenaltyState(counts, prompt_mask, f("frequency_penalty"), f("presence_penalty"),
                        f("repetition_penalty"), bias)


def replay_seeded(target_probs: torch.Tensor, requests: list[Request],
                  lengths: torch.Tensor) -> torch.Tensor:
    """Turn seeded requests' target distributions into one-hot replay samples (module doc).

    Args:
        target_probs: [R, gamma + 1, V] float32 warped target distributions; row r uses
            positions 0..lengths[r].
        requests: the R requests.
        lengths: [R] int64 verified draft lengths.
    Returns:
        target_probs with the used positions of seeded rows replaced by one-hot samples
        (modified in place and returned).
    """
    rows, cols, us = [], [], []
    for i, r in enumerate(requests):
        if r.params.seed is None:
            continue
        base = len(r.output_ids)
        for j in range(int(lengths[i]) + 1):
            rows.append(i)
            cols.append(j)
            us.append(seeded_uniform(r.params.seed, base + j))
    if rows:
        ri = torch.tensor(rows, device=target_probs.device)
        ci = torch.tensor(cols, device=target_probs.device)
        u = torch.tensor(us, dtype=torch.float32, device=target_probs.device)
        tokens = sample_from_probs(target_probs[ri, ci], u)
        target_probs[ri, ci] = 0.0
        target_probs[ri, ci, tokens] = 1.0
    return target_probs
