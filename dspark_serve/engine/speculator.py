"""Drafting, calibration and verify-length scheduling for the decoding requests of one step
(paper Eq 2-7, STS, Algorithm 1 / Section 5.2).

The speculator owns the drafter's context cache (one slot per target KV slot) and the
scheduler. Committed tokens' target taps are projected into that cache lazily, in one batch
right before the next draft: steps that do not draft (the async scheduler found drafting not
worth it) then cost no drafter work at all. Each step: draft a block per decoding request,
turn confidence logits into calibrated conditional survival c_{r,k} = sigmoid(z_{r,k} / T_k),
and let the scheduler pick l_r. Per-request caps (remaining max_tokens, the context limit) are applied by zeroing the
survival of slots past the cap before scheduling and clamping after it; both depend only on
the request's state, never on its drafted tokens, so verification stays lossless.
"""
from __future__ import annotations

import time

import torch

from dspark_serve.calibration.sts import calibrated_confidence
from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.scheduling import make_scheduler
from dspark_serve.scheduling.cost_table import CostTable
from dspark_serve.types import DraftBlock, SamplingTensors


class Speculator:
    """Drafter + calibration + scheduler.

    Args:
        drafter: the drafter (its block gives up to ``drafter.gamma`` draft tokens).
        gamma: draft tokens used per round, 1..drafter.gamma.
        scheduler: scheduler name (``dspark_serve.scheduling.SCHEDULER_NAMES``).
        cost_table: SPS cost table (algorithm1 / async).
        temperatures: [gamma] float32 STS temperatures, or None (T = 1).
        threshold: cut-off of the threshold scheduler.
        max_batch_tokens: cap on the verify batch B (None = none).
        num_slots, max_len: size of the drafter's context cache.
        always_draft: draft every step (``should_draft`` always True).
    Raises:
        ValueError: gamma out of range, temperatures of the wrong length, scheduler errors.
    """

    def __init__(self, drafter: DSparkDrafter, *, gamma: int, scheduler: str,
                 cost_table: CostTable | None, temperatures: torch.Tensor | None,
                 threshold: float, max_batch_tokens: int | None, num_slots: int, max_len: int,
                 always_draft: bool = False):
        if not 1 <= gamma <= drafter.gamma:
            raise ValueError(f"gamma must be in 1..{drafter.gamma} (the drafter's block), got {gamma}")
        if temperatures is not None and temperatures.shape != (gamma,):
            raise ValueError(f"STS calibration has {temperatures.numel()} temperatures, gamma is "
                             f"{gamma}")
        self.drafter = drafter
        self.gamma = gamma
        self.has_confidence = drafter.confidence_head is not None
        self.temperatures = temperatures
        self.scheduler = make_scheduler(scheduler, gamma=gamma, cost_table=cost_table,
                                        threshold=threshold, max_batch_tokens=max_batch_tokens)
        self.cache = drafter.new_cache(num_slots, max_len)
        self.always_draft = always_draft
        # (slots [N], positions [N], taps [N, C]) committed since the last draft, in order.
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def should_draft(self, num_requests: int) -> bool:
        """Whether this step drafts for its R decoding requests: the scheduler's
        ``worth_drafting`` where it has one (async: drafting must pay for its own time), else
        always; always with ``always_draft``. False means a plain decode step (verify lengths
        0)."""
        decide = getattr(self.scheduler, "worth_drafting", None)
        return self.always_draft or decide is None or bool(decide(num_requests))

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's context, pending taps included (a new request takes it)."""
        pending, self._pending = self._pending, []
        for slots, positions, taps in pending:
            keep = slots != slot
            if bool(keep.any()):
                self._pending.append((slots[keep], positions[keep], taps[keep]))
        self.cache.reset(torch.tensor([slot], device=self.cache.lengths.device))

    def extend(self, slots: torch.Tensor, positions: torch.Tensor, taps: torch.Tensor) -> None:
        """Add committed tokens' target taps ([N] slots, [N] positions, [N, C]) to the
        context (projected at the next ``propose``, or ``flush``)."""
        if slots.numel():
            self._pending.append((slots, positions, taps))

    def flush(self) -> None:
        """Project every pending committed token into the drafter's context now."""
        if self._pending:
            slots, positions, taps = (torch.cat(parts) for parts in zip(*self._pending))
            self._pending = []
            self.drafter.extend_context(self.cache, slots, positions, taps)

    def propose(self, slots: torch.Tensor, anchors: torch.Tensor, anchor_positions: torch.Tensor,
                sampling: SamplingTensors, uniforms: torch.Tensor,
                caps: torch.Tensor) -> tuple[DraftBlock, torch.Tensor]:
        """Draft and schedule one round for R requests.

        Args:
            slots, anchors, anchor_positions: [R] int64.
            sampling: R rows of warping parameters (same as the verifier's).
            uniforms: [R, drafter.gamma] float32 draft uniforms.
            caps: [R] int64 most draft tokens each request may verify (0..gamma).
        Returns:
            (block truncated to gamma, lengths [R] int64 l_r in 0..caps[r]).
        """
        self.flush()   # catching up on skipped steps is not this draft's cost
        start = time.perf_counter()
        block = self.drafter.draft(self.cache, slots, anchors, anchor_positions, sampling, uniforms)
        observe = getattr(self.scheduler, "observe_draft", None)
        if observe is not None:
            if block.tokens.is_cuda:
                torch.cuda.synchronize(block.tokens.device)
            observe(int(slots.numel()), time.perf_counter() - start)
        g = self.gamma
        block = DraftBlock(block.tokens[:, :g], block.probs[:, :g], block.conf_logits[:, :g])
        if self.has_confidence:
            temps = (self.temperatures if self.temperatures is not None
                     else torch.ones(g, device=block.conf_logits.device))
            confidence = calibrated_confidence(block.conf_logits, temps)
        else:
            confidence = torch.ones_like(block.conf_logits)
        allowed = torch.arange(g, device=caps.device)[None, :] < caps[:, None]
        lengths = self.scheduler(confidence * allowed)
        return block, torch.minimum(lengths, caps)
