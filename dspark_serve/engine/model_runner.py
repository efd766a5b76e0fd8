"""The model side of one engine step: draft, lay out, forward.

For a ``StepPlan`` the runner lets the speculator draft and schedule a block for every
decoding request (unless it finds drafting not worth this step), fits the drafts of
grammar-constrained requests to their grammars, flattens every request's tokens into one
batch, computes the step's ``SpecMetadata`` and runs ONE target forward over it. Committed
tokens' target taps go back into the drafter's context through ``ContextUpdates``.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from dspark_serve.engine.batch import StepPlan
from dspark_serve.engine.speculator import Speculator
from dspark_serve.model.kv_cache import KVCache
from dspark_serve.model.target_model import TargetModel
from dspark_serve.sampling.sampler import draw_uniforms
from dspark_serve.structured.masking import constrain_drafts
from dspark_serve.types import dense_draft_probs
from dspark_serve.verify.metadata import SpecMetadata
from dspark_serve.verify.target_sampler import SamplingBatch, Verdict


@dataclass(frozen=True)
class ModelRun:
    """One step's forward (T flat tokens, N logit rows, C tap channels).

    meta: the verify layout; logits: [N, V] float32; taps: [T, C] target taps of every flat
    token; starts: flat index of each request's first token (decoding, then prefill
    requests); grammar_seconds: time spent fitting drafts to grammars; batch_tokens: T of a
    step without prefill tokens (what the verify-length scheduler prices), else None;
    propose_seconds: time spent proposing (lookup, drafting, scheduling, grammar fitting) in
    a step that proposed, else None.
    """

    meta: SpecMetadata
    logits: torch.Tensor
    taps: torch.Tensor
    starts: list[int]
    grammar_seconds: float
    batch_tokens: int | None = None
    propose_seconds: float | None = None


class ContextUpdates:
    """Flat token indices whose target taps go into the drafter's context, with their
    (slot, position)."""

    def __init__(self):
        self.idx: list[int] = []
        self.slots: list[int] = []
        self.pos: list[int] = []

    def add(self, flat_start: int, slot: int, position: int, count: int) -> None:
        self.idx += range(flat_start, flat_start + count)
        self.slots += [slot] * count
        self.pos += range(position, position + count)


class ModelRunner:
    """Target forward and drafting for the engine's steps.

    Args:
        target, kv: the target model and its KV cache.
        speculator: drafting and verify-length scheduling, or None for plain decoding.
        gamma: draft tokens per round (0 without a speculator).
        max_model_len: context limit (caps the drafts of requests near it).
        mask_drafts: redraw drafts a grammar forbids (``EngineConfig.mask_drafts``).
    """

    def __init__(self, target: TargetModel, kv: KVCache, speculator: Speculator | None, *,
                 gamma: int, max_model_len: int, mask_drafts: bool):
        self.target = target
        self.kv = kv
        self.speculator = speculator
        self.gamma = gamma
        self.max_model_len = max_model_len
        self.mask_drafts = mask_drafts
        self.device = target.device

    def run(self, plan: StepPlan, batch: SamplingBatch) -> ModelRun:
        """Draft (filling ``plan.block`` / ``plan.lengths``), then forward the whole step.
        ``batch`` holds the plan's verify rows (its first R_d rows are ``plan.decode``)."""
        grammar_seconds, propose_seconds = 0.0, None
        if plan.decode and self.speculator is not None \
                and self.speculator.should_draft(len(plan.decode)):
            start = time.perf_counter()
            self.propose(plan, batch)
            grammar_seconds = self.constrain_drafts(plan, batch)
            propose_seconds = time.perf_counter() - start
        ids, slots, pos, starts = plan.flat_tokens()
        drafts, draft_probs = plan.verify_drafts(self.device)
        lengths = plan.lengths.tolist() + [0] * len(plan.prefill_done)
        meta = SpecMetadata.build(plan.verify_first_tokens(starts), lengths, drafts,
                                  draft_probs, plan.gamma, self.device)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)
        out = self.target.forward(as_tensor(ids), as_tensor(slots), as_tensor(pos), self.kv,
                                  meta.logit_indices)
        return ModelRun(meta, out.logits, out.taps, starts, grammar_seconds,
                        None if plan.prefill else len(ids), propose_seconds)

    def propose(self, plan: StepPlan, batch: SamplingBatch) -> None:
        """Draft and schedule the decoding requests (fills plan.block / plan.lengths)."""
        reqs, d = plan.decode, self.device
        spec = self.speculator
        texts = [r.prompt_ids + r.output_ids for r in reqs]
        lookup_round, drafter_runs = None, None
        if spec.lookup is not None:
            lookup_round = spec.lookup_drafts([r.slot for r in reqs], texts)
            if not any(lookup_round.found):
                # no lookup draft: the drafter alone decides (asked once per step)
                drafter_runs = spec.drafter is not None and spec.drafter_pays(len(reqs))
                if not drafter_runs:
                    # a plain step, without the tensor work of proposing (~0.5 ms of a 9 ms
                    # step at one user); propose would return the same (no block, lengths 0)
                    plan.block, plan.lengths, plan.gamma = None, torch.zeros(
                        len(reqs), dtype=torch.int64), 0
                    return
        caps = torch.tensor([max(0, min(self.gamma, r.params.max_tokens - len(r.output_ids) - 1,
                                        self.max_model_len - r.num_tokens - 1)) for r in reqs],
                            dtype=torch.int64, device=d)
        drafter = spec.drafter
        decode_rows = torch.arange(len(reqs), device=d)
        plan.block, lengths = spec.propose(
            torch.tensor([r.slot for r in reqs], device=d),
            torch.tensor([r.anchor for r in reqs], device=d),
            torch.tensor([r.num_tokens - 1 for r in reqs], device=d),
            texts, batch.sampling.select(decode_rows),
            draw_uniforms(batch.generators[:len(reqs)], drafter.gamma if drafter else 0, d), caps,
            lookup_round, drafter_runs)
        plan.lengths = lengths.cpu()
        plan.gamma = self.gamma if plan.block is not None else 0   # None: a plain step

    def constrain_drafts(self, plan: StepPlan, batch: SamplingBatch) -> float:
        """Fit the drafted blocks of grammar-constrained requests to their grammars
        (``structured.masking.constrain_drafts``; shortens ``plan.lengths``); returns the
        seconds spent."""
        states = batch.grammars[:len(plan.decode)]
        if plan.block is None or all(s is None for s in states):
            return 0.0
        start = time.perf_counter()
        uniforms = None
        if self.mask_drafts:
            uniforms = draw_uniforms(batch.generators[:len(plan.decode)], plan.gamma, self.device)
        plan.lengths = plan.lengths.clone()
        # the grammar masks and renormalises the draft distributions in place
        plan.block = dataclasses.replace(plan.block, probs=dense_draft_probs(
            plan.block.tokens, plan.block.probs, self.target.weights.vocab_size))
        constrain_drafts(states, plan.block.tokens, plan.block.probs, plan.lengths, uniforms)
        return time.perf_counter() - start

    def observe(self, plan: StepPlan, run: ModelRun, verdict: Verdict) -> None:
        """Hand the step's verify outcomes to the speculator (lookup survival and the
        proposing gate follow them)."""
        if self.speculator is None or run.propose_seconds is None:
            return
        accepted = verdict.num_accepted[:len(plan.decode)]
        self.speculator.observe_proposal(plan.lengths, accepted, run.propose_seconds)
        if plan.block is not None:
            self.speculator.observe(plan.lengths, accepted)

    def observe_step(self, run: ModelRun, seconds: float) -> None:
        """Hand the step's wall time (seconds) to the speculator, which prices verification
        by served steps (``Speculator.observe_step``)."""
        if self.speculator is not None:
            self.speculator.observe_step(run.batch_tokens, seconds)

    def extend_context(self, updates: ContextUpdates, taps: torch.Tensor) -> None:
        """Hand the committed tokens' taps ([T, C] of the step's flat tokens) to the drafter."""
        if self.speculator is None or self.speculator.drafter is None:   # ngram: no context
            return
        self.speculator.extend(updates.slots, updates.pos, taps, updates.idx)
