"""Request scheduling (which requests run in a step), as opposed to verify-length scheduling
(``dspark_serve.scheduling``: how many drafts each running request verifies).

Requests wait in arrival order and are admitted first come, first served while the KV cache
has a free slot; a running request keeps its slot until it finishes or is aborted. Each step
runs every running request: prefill chunks of at most ``prefill_chunk`` prompt tokens in total
(oldest first) and a verify block for every request past its prompt (``batch.plan_step``).
"""
from __future__ import annotations

from typing import Callable

from dspark_serve.engine.batch import StepPlan, plan_step
from dspark_serve.engine.request import Request
from dspark_serve.model.kv_cache import KVCache


class RequestScheduler:
    """Waiting and running queues over the slots of one KV cache.

    Args:
        kv: the target's KV cache (slots are allocated and freed here).
        prefill_chunk: most prompt tokens prefilled in one step.
        on_admit: called with the slot of every admitted request (the drafter forgets the
            slot's previous context), or None.
    """

    def __init__(self, kv: KVCache, prefill_chunk: int,
                 on_admit: Callable[[int], None] | None = None):
        self.kv = kv
        self.prefill_chunk = prefill_chunk
        self.on_admit = on_admit
        self.waiting: list[Request] = []
        self.running: list[Request] = []

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
        """Admit waiting requests into free slots, then plan the step over every running
        request; None when nothing runs."""
        while self.waiting and self.kv.num_free_slots:
            req = self.waiting.pop(0)
            req.slot = self.kv.allocate()
            if self.on_admit is not None:
                self.on_admit(req.slot)
            self.running.append(req)
        return plan_step(self.running, self.prefill_chunk) if self.running else None

    def release(self, request: Request) -> None:
        """Stop running ``request`` and free its slot (no-op when it is not running)."""
        if request in self.running:
            self.running.remove(request)
            self.kv.free(request.slot)
            request.slot = -1
