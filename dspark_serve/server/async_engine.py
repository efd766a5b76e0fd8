"""Runs the single-threaded ``LLMEngine`` step loop in one background thread and connects it
to asyncio request handlers.

Only the engine thread calls the engine. Handlers submit and abort requests through a
thread-safe command queue; the engine thread hands each step's outputs back to the event loop
with one ``loop.call_soon_threadsafe`` per step, into one asyncio queue per HTTP request (a
``RequestGroup``: the n choices of one HTTP request share it). A failure confined to one request
(``RequestFailed``) is reported to that request only; any other exception from the engine fails
the requests in flight, and the thread keeps serving new ones.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable

from dspark_serve.engine.outputs import RequestFailed, RequestOutput, StepStats
from dspark_serve.engine.params import SamplingParams

logger = logging.getLogger(__name__)

StatsCallback = Callable[[list[StepStats], int, bool], None]


class EngineError(RuntimeError):
    """A request failed inside the engine (not because of its input)."""


class RequestGroup:
    """Outputs of the engine requests behind one HTTP request, in step order.

    Iterate with ``async for out in group``; iteration ends when every request has finished and
    raises the request's error if one failed. ``unfinished`` is the set of request ids still
    running (for aborting on client disconnect).
    """

    def __init__(self, request_ids: list[str]):
        self.request_ids = list(request_ids)
        self.unfinished = set(request_ids)
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.unfinished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
        return item


class AsyncEngine:
    """Owns the engine thread.

    Args:
        engine: an ``LLMEngine`` (or anything with its API).
        on_step_stats: called in the engine thread after every loop iteration (a step, or
            adds/aborts while idle) with the step statistics popped from the engine
            (``engine.pop_step_stats()``, if it has one; empty without a step),
            ``engine.kv_free_tokens()`` and whether the engine is now idle.
    """

    def __init__(self, engine, on_step_stats: StatsCallback | None = None):
        self.engine = engine
        self.on_step_stats = on_step_stats
        self.kv_free_tokens = engine.kv_free_tokens()  # snapshot, refreshed by the engine thread
        self.num_in_flight = 0                          # snapshot of requests the thread tracks
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._groups: dict[str, RequestGroup] = {}      # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams]]) -> RequestGroup:
        """Add requests (request_id, prompt_token_ids, params) as one group.

        Returns once the engine thread has accepted all of them. Raises the engine's
        ValueError (and adds none of them) if it rejects one.
        """
        if not self.alive:
            raise EngineError("the engine is not running")
        group = RequestGroup([rid for rid, _, _ in requests])
        accepted = self._loop.create_future()
        self._commands.put(("add", group, requests, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(group.request_ids)
            raise
        return group

    def abort(self, request_ids) -> None:
        """Abort requests (finished or unknown ids are ignored); thread-safe, non-blocking."""
        self._commands.put(("abort", list(request_ids)))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; requests in flight are aborted and see an EngineError."""
        if self._thread is not None:
            self._commands.put(("stop",))
            self._thread.join(timeout)

    # ---- engine thread ----

    def _next_commands(self) -> list[tuple]:
        """Commands queued so far; waits for one while the engine has nothing to do."""
        try:
            busy = self.engine.has_unfinished()
        except Exception:
            logger.exception("engine.has_unfinished failed")
            busy = False
        commands = [] if busy else [self._commands.get()]
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _run(self) -> None:
        while True:
            commands = self._next_commands()
            if any(cmd[0] == "stop" for cmd in commands):
                stopping = EngineError("server is shutting down")
                self._post([(cmd[3], stopping) for cmd in commands if cmd[0] == "add"])
                self._fail(list(self._groups), stopping)
                return
            try:
                for cmd in commands:
                    if cmd[0] == "add":
                        self._add(*cmd[1:])
                    else:
                        self._abort(cmd[1])
                if self.engine.has_unfinished():
                    self._step()
                self.kv_free_tokens = self.engine.kv_free_tokens()
            except Exception as exc:  # the thread must outlive any engine bug
                logger.exception("engine loop error; failing the %d requests in flight",
                                 len(self._groups))
                self._fail(list(self._groups), EngineError(f"engine error: {exc}"))
            self._report_stats()  # before num_in_flight, which callers poll for idleness
            self.num_in_flight = len(self._groups)

    def _add(self, group: RequestGroup, requests, accepted: asyncio.Future) -> None:
        added = []
        try:
            for rid, prompt, params in requests:
                self.engine.add_request(rid, prompt, params)
                added.append(rid)
        except Exception as exc:  # reject the whole group, engine keeps serving
            self._post([(accepted, exc)])
            for rid in added:
                self.engine.abort_request(rid)
            return
        for rid in added:
            self._groups[rid] = group
        self._post([(accepted, None)])

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._groups.pop(rid, None) is not None:
                self.engine.abort_request(rid)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except RequestFailed as exc:
            logger.error("request %s failed: %s", exc.request_id, exc)
            self._fail([exc.request_id], EngineError(str(exc)))
            outputs = exc.outputs
        batch = []
        for out in outputs:
            group = self._groups.get(out.request_id)
            if group is None:  # aborted while the step ran
                continue
            if out.finished:
                del self._groups[out.request_id]
            batch.append((group.queue, out))
        self._post(batch)

    def _report_stats(self) -> None:
        # Also after aborts while idle, so gauges (running, waiting, free KV) never go stale.
        if self.on_step_stats is None:
            return
        pop = getattr(self.engine, "pop_step_stats", None)
        try:
            self.on_step_stats(pop() if pop is not None else [], self.engine.kv_free_tokens(),
                               not self.engine.has_unfinished())
        except Exception:  # losing metrics must not fail requests
            logger.exception("step statistics callback failed")

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        """Drop requests from the engine and deliver ``error`` to their groups."""
        batch = []
        for rid in request_ids:
            group = self._groups.pop(rid, None)
            try:
                self.engine.abort_request(rid)
            except Exception:  # already dropped, or the engine is broken: keep going
                logger.exception("abort of failed request %s failed", rid)
            if group is not None:
                batch.append((group.queue, error))
        self._post(batch)

    def _post(self, batch: list) -> None:
        """Deliver (queue, item) and (future, exception-or-None) pairs on the event loop."""
        if batch:
            try:
                self._loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # event loop closed: nobody is listening any more
                pass


def _deliver(batch: list) -> None:
    for target, item in batch:
        if isinstance(target, asyncio.Future):
            if not target.done():
                target.set_result(None) if item is None else target.set_exception(item)
        else:
            target.put_nowait(item)
