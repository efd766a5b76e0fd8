"""After the forward: commit each verify row's tokens, record the round, emit output deltas,
and collect what enters the drafter's context.

A decoding request's anchor and accepted drafts now have target K/V, so they enter the
drafter's context (the last committed token becomes the next anchor); a prefill chunk's tokens
enter it as well. One request failing to commit (e.g. a grammar refusing a token) is released
and reported without taking the others down.
"""
from __future__ import annotations

import logging
from typing import Callable

from dspark_serve.engine.batch import StepPlan
from dspark_serve.engine.commit import commit_tokens
from dspark_serve.engine.model_runner import ContextUpdates, ModelRun
from dspark_serve.engine.outputs import RequestFailed, RequestOutput, SpecStats, StepStats
from dspark_serve.engine.request import Request
from dspark_serve.verify.target_sampler import Verdict

logger = logging.getLogger(__name__)


def postprocess(plan: StepPlan, run: ModelRun, verdict: Verdict, stats: StepStats, *,
                eos_ids: set[int], max_model_len: int, gamma: int,
                release: Callable[[Request], None]
                ) -> tuple[list[RequestOutput], RequestFailed | None, ContextUpdates]:
    """Commit the step's verified tokens.

    Args:
        plan, run, verdict: the step's plan, forward and verification.
        stats: this step's statistics (tokens and rounds are added).
        eos_ids, max_model_len: stop conditions (``commit.commit_tokens``).
        gamma: draft tokens per round (0 without speculation: no rounds are recorded).
        release: frees a failed request's slot at once.
    Returns:
        (output deltas of the verify rows, the first failure or None, context updates).
    """
    outputs, failure, context = [], None, ContextUpdates()
    meta, starts = run.meta, run.starts
    for i, req in enumerate(plan.verify_requests):
        try:
            n_acc, tokens = verdict.num_accepted[i], verdict.tokens[i]
            rows = (run.logits[meta.offsets[i]:meta.offsets[i] + len(tokens)]
                    if req.params.logprobs else None)
            stats.generated_tokens += commit_tokens(req, tokens, rows, eos_ids, max_model_len)
            if i < len(plan.decode):
                if plan.block is not None:  # a step that skipped drafting is no round
                    record_round(stats, req, gamma, meta.lengths[i], n_acc)
                if not req.finished:  # anchor + accepted drafts now have target K/V
                    context.add(starts[i], req.slot, req.num_tokens - n_acc - 2, n_acc + 1)
                    req.num_computed = req.num_tokens - 1
            outputs.append(output_delta(req))
        except Exception as exc:  # one bad request must not take the others down
            logger.exception("request %s failed", req.request_id)
            release(req)
            failure = failure or RequestFailed(req.request_id, f"internal error: {exc}")
    for k, (req, n) in enumerate(plan.prefill):
        if req.slot >= 0 and not req.finished:
            context.add(starts[len(plan.decode) + k], req.slot, req.num_computed, n)
            req.num_computed += n
    return outputs, failure, context


def record_round(stats: StepStats, req: Request, gamma: int, l_r: int, n_acc: int) -> None:
    """Count one verify round of ``req`` (l_r drafts verified, n_acc accepted)."""
    req.record_round(gamma, n_acc)
    stats.rounds += 1
    stats.verify_tokens += l_r + 1
    stats.drafted_tokens += gamma
    stats.accepted_tokens += n_acc
    by_format = stats.rounds_by_format.setdefault(req.output_format, SpecStats())
    by_format.verify_rounds += 1
    by_format.drafted_tokens += gamma
    by_format.accepted_tokens += n_acc
    if not stats.accepted_per_position:
        stats.accepted_per_position = [0] * gamma
        stats.verified_per_position = [0] * gamma
    for k in range(l_r):
        stats.verified_per_position[k] += 1
        stats.accepted_per_position[k] += k < n_acc


def output_delta(req: Request) -> RequestOutput:
    """What ``req`` produced since its last delta (ids, text, logprobs)."""
    new_ids = req.output_ids[req.emitted_tokens:]
    req.emitted_tokens = len(req.output_ids)
    logprobs = top = None
    if req.params.logprobs:
        logprobs = req.logprobs[req.emitted_logprobs:]
        top = req.top_logprobs[req.emitted_logprobs:]
        req.emitted_logprobs = len(req.logprobs)
    return RequestOutput(req.request_id, new_ids, req.detokenizer.pop_delta(req.finished),
                         logprobs, top, req.finished, req.finish_reason,
                         len(req.prompt_ids), len(req.output_ids), req.stats)
