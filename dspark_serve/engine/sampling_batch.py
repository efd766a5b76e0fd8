"""A step's sampling inputs, read from its requests once: warping parameters, penalty state,
random streams, seeds and grammar states (``verify.target_sampler.SamplingBatch``)."""
from __future__ import annotations

import torch

from dspark_serve.engine.request import Request
from dspark_serve.types import SamplingTensors
from dspark_serve.verify.penalties import PenaltyState
from dspark_serve.verify.target_sampler import SamplingBatch


def sampling_batch(requests: list[Request], vocab_size: int, device: torch.device,
                   generator: torch.Generator) -> SamplingBatch:
    """The R requests' sampling inputs, in order; ``generator`` serves requests without a seed."""
    return SamplingBatch(sampling_tensors(requests, device),
                         penalty_state(requests, vocab_size, device),
                         [r.generator or generator for r in requests],
                         [r.params.seed for r in requests],
                         [len(r.output_ids) for r in requests],
                         [r.grammar for r in requests])


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
