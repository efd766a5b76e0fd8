"""Request scheduling (which requests run in a step), as opposed to verify-length scheduling
(``dspark_serve.scheduling``: how many drafts each running request verifies).

Requests wait in arrival order and are admitted first come, first served once a KV slot and
pages for their prompt, their first token and one draft block are free (the head of the queue
waits for pages rather than being overtaken); a running request keeps its slot and pages until
it finishes or is aborted. Each step runs every running request: prefill chunks of at most
``prefill_chunk`` prompt tokens in total (oldest first) and a verify block for every request
past its prompt (``batch.plan_step``).

KV memory is a pool of pages (``model.kv_cache``, ``EngineConfig.kv_cache_tokens``): before
each step a decoding request gets pages for its anchor and gamma drafts. When the pool cannot
grow one, the newest running request is preempted as in vLLM: its pages are freed and it goes
back to the head of the queue with its tokens so far, to be recomputed (prefilled again,
without sampling, ``Request.prefill_len``) when pages free up. The pool holds at least one
request of max_model_len, so the oldest request always fits: the engine never stalls, and
preemption changes no token (its K/V are recomputed from the same tokens).
"""
from __future__ import annotations

import logging
from typing import Callable

from dspark_serve.engine.batch import StepPlan, plan_step
from dspark_serve.engine.request import Request
from dspark_serve.model.kv_cache import KVCache

logger = logging.getLogger(__name__)


class RequestScheduler:
    """Waiting and running queues over the slots and pages of one KV cache.

    Args:
        kv: the target's KV cache (slots and pages are allocated and freed here).
        prefill_chunk: most prompt tokens prefilled in one step.
        gamma: draft tokens a verify block may add (pages are reserved for them).
        max_model_len: context limit in tokens (no reservation goes past it).
        on_admit: called with the slot of every admitted request (the drafter forgets the
            slot's previous context), or None.
    """

    def __init__(self, kv: KVCache, prefill_chunk: int, *, gamma: int = 0,
                 max_model_len: int, on_admit: Callable[[int], None] | None = None):
        self.kv = kv
        self.prefill_chunk = prefill_chunk
        self.gamma = gamma
        self.max_model_len = max_model_len
        self.on_admit = on_admit
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def holds(self, request_id: str) -> bool:
        """Whether a waiting or running request has this id."""
        return any(r.request_id == request_id for r in self.waiting + self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Drop a request and free its slot now; unknown or finished ids are ignored."""
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        for r in [r for r in self.running if r.request_id == request_id]:
            self.release(r)

    def schedule(self) -> StepPlan | None:
        """Reserve the decoding requests' pages, admit waiting requests (module docstring),
        then plan the step over every running request; None when nothing runs."""
        self._reserve_decode_pages()
        while self.waiting:
            req = self.waiting[0]
            need = min(req.num_tokens + 1 + self.gamma, self.max_model_len)
            if not self.kv.can_allocate(need):
                break
            self.waiting.pop(0)
            req.slot = self.kv.allocate(need)
            if self.on_admit is not None:
                self.on_admit(req.slot)
            self.running.append(req)
        return plan_step(self.running, self.prefill_chunk) if self.running else None

    def _reserve_decode_pages(self) -> None:
        """Give every decoding request, oldest first, pages for this step's writes: its anchor
        and up to gamma drafts (positions up to num_tokens - 1 + gamma). When the pool runs
        dry, preempt the newest running request (possibly the one growing) and retry."""
        for req in list(self.running):
            if req not in self.running or req.prefilling:  # preempted, or pages reserved
                continue
            need = min(req.num_tokens + self.gamma, self.max_model_len)
            while not self.kv.reserve(req.slot, need):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break

    def _preempt(self, req: Request) -> None:
        """Free a running request's pages and queue it first to be recomputed
        (``Request.prefill_len``); its tokens, sampling state and grammar state stay."""
        self.release(req)
        req.num_computed = 0
        self.waiting.insert(0, req)
        self.num_preemptions += 1
        logger.info("KV pool full: request %s preempted (%d tokens to recompute)",
                    req.request_id, req.prefill_len)

    def release(self, request: Request) -> None:
        """Stop running ``request`` and free its slot and pages (no-op when it is not
        running)."""
        if request in self.running:
            self.running.remove(request)
            self.kv.free(request.slot)
            request.slot = -1
