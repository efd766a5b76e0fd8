"""Layout of one engine step: which requests run, and their tokens flattened into one batch.

Flat order: every decoding request's verify block (anchor, then its l_r drafts), then every
prefill chunk. The verify rows are the decoding requests, then the requests whose prompt
completes this step (l = 0); ``verify.metadata.SpecMetadata`` places their logit rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark_serve.engine.request import Request
from dspark_serve.types import DraftBlock


@dataclass
class StepPlan:
    """What one step runs (R_d decoding requests, gamma draft positions, V vocabulary).

    decode:          decoding requests, in verify order.
    prefill:         (request, number of prompt tokens this step) for every prefill chunk
                     (a preempted request's "prompt" is ``Request.prefill_len`` tokens).
    gamma:           draft positions of this step's blocks (0 without speculation).
    block:           the drafted blocks of ``decode`` ([R_d, gamma] tokens / probs), or None.
    lengths:         [R_d] int64 (CPU) verify lengths l_r.
    prefill_done:    requests whose prompt completes this step (their first token is sampled
                     now; a preempted request that completes its recompute decodes from the
                     next step). Fixed when the step is planned: committing changes the
                     requests it is computed from.
    """

    decode: list[Request]
    prefill: list[tuple[Request, int]]
    gamma: int = 0
    block: DraftBlock | None = None
    lengths: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [R_d]
    prefill_done: list[Request] = field(default_factory=list)

    @property
    def verify_requests(self) -> list[Request]:
        return self.decode + self.prefill_done

    def flat_tokens(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(token ids, slots, positions, flat index of each request's first token), the last in
        ``decode`` then ``prefill`` order."""
        ids, slots, pos, starts = [], [], [], []
        drafts = self.block.tokens.tolist() if self.block is not None else None
        for i, r in enumerate(self.decode):
            l_r, p = int(self.lengths[i]), r.num_tokens - 1
            starts.append(len(ids))
            ids += [r.anchor] + (drafts[i][:l_r] if l_r else [])
            slots += [r.slot] * (l_r + 1)
            pos += range(p, p + l_r + 1)
        for r, n in self.prefill:
            starts.append(len(ids))
            ids += (r.prompt_ids + r.output_ids)[r.num_computed:r.num_computed + n]
            slots += [r.slot] * n
            pos += range(r.num_computed, r.num_computed + n)
        return ids, slots, pos, starts

    def verify_first_tokens(self, starts: list[int]) -> list[int]:
        """Flat index of each verify row's first verified token: a decoding request's anchor,
        the last prompt token of a completed prefill (``starts`` from ``flat_tokens``)."""
        first = starts[:len(self.decode)]
        done = {id(r) for r in self.prefill_done}
        for k, (r, n) in enumerate(self.prefill):
            if id(r) in done:
                first.append(starts[len(self.decode) + k] + n - 1)
        return first

    def verify_drafts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens [R_v, gamma] int64 and probs [R_v, gamma, V] float32 of the verify rows
        (zeros for completed prompts, which verify nothing); probs None = one-hot at the
        tokens (``DraftBlock.probs``)."""
        extra = len(self.prefill_done)
        if self.block is None:
            return (torch.zeros(len(self.decode) + extra, 0, dtype=torch.int64, device=device),
                    None)
        tokens = torch.cat([self.block.tokens, self.block.tokens.new_zeros(extra, self.gamma)])
        probs = self.block.probs
        if probs is not None and extra:
            probs = torch.cat([probs, probs.new_zeros(extra, *probs.shape[1:])])
        return tokens, probs


def plan_step(running: list[Request], prefill_chunk: int) -> StepPlan:
    """Split the running requests into decoding requests and prefill chunks of at most
    ``prefill_chunk`` prompt tokens in total (oldest requests first)."""
    decode = [r for r in running if not r.prefilling]
    prefill, budget = [], prefill_chunk
    for r in running:
        if r.prefilling and budget > 0:
            n = min(budget, r.prefill_len - r.num_computed)
            prefill.append((r, n))
            budget -= n
    done = [r for r, n in prefill if not r.output_ids and r.num_computed + n == len(r.prompt_ids)]
    return StepPlan(decode, prefill, lengths=torch.zeros(len(decode), dtype=torch.int64),
                    prefill_done=done)
