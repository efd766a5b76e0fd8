"""The FastAPI app: OpenAI-compatible /v1/completions, /v1/chat/completions (streamed as SSE
or not), /v1/models, plus /health and /metrics, over one ``LLMEngine`` in a background thread.

Bad requests get an OpenAI error object with a 4xx status and never reach the engine; a client
that disconnects (mid-stream or while waiting for a non-streamed body) has its engine requests
aborted, which frees their KV cache and leaves other requests untouched.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_serve.server.async_engine import AsyncEngine, EngineError, RequestGroup
from dspark_serve.server.inputs import (chat_prompt, completion_prompts, expand_choices, parse_body,
                                        sampling_params)
from dspark_serve.server.metrics import ServerMetrics
from dspark_serve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                          ModelCard, ModelList)
from dspark_serve.server.responses import ResponseBuilder, TokenTexts

logger = logging.getLogger(__name__)
MODEL_ALIAS = "default"  # accepted as the model name besides engine.model_name


class EventStream(StreamingResponse):
    """SSE response that runs ``on_close`` however the stream ends: finished, client gone
    mid-stream, or cancelled before the body generator even started."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            self.on_close()
            await self.body_iterator.aclose()


def _json(model, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


async def _wait_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(engine) -> FastAPI:
    """App serving ``engine`` (an ``LLMEngine`` or anything with its API); the engine thread
    starts and stops with the app's lifespan."""
    metrics = ServerMetrics()
    async_engine = AsyncEngine(engine, on_step_stats=metrics.observe)
    token_texts = TokenTexts(engine.tokenizer)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="dspark-serve", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return _json(exc.body, exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _json(APIError(exc.status_code, str(exc.detail)).body, exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("internal error on %s", request.url.path)
        return _json(APIError(500, "Internal server error.", type="server_error").body, 500)

    def model_card() -> ModelCard:
        return ModelCard(id=engine.model_name, created=started, max_model_len=engine.max_model_len)

    @app.get("/health")
    async def health() -> Response:
        ok = async_engine.alive
        return Response('{"status": "%s"}' % ("ok" if ok else "engine stopped"),
                        status_code=200 if ok else 503, media_type="application/json")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return _json(ModelList(data=[model_card()]))

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> Response:
        check_model(model)
        return _json(model_card())

    def check_model(name: str | None) -> None:
        if name is not None and name not in (engine.model_name, MODEL_ALIAS):
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_body(await request.body(), ChatCompletionRequest)
        check_model(req.model)
        return await generate(request, "chat", req, [chat_prompt(engine.tokenizer, req)])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_body(await request.body(), CompletionRequest)
        check_model(req.model)
        prompts = completion_prompts(engine.tokenizer, req, engine.vocab_size)
        return await generate(request, "completion", req, prompts)

    async def generate(request: Request, kind: str, req, prompts: list[list[int]]) -> Response:
        base = uuid.uuid4().hex
        requests, prompt_of_choice = [], []
        for p, prompt in enumerate(prompts):
            params = sampling_params(req, len(prompt), engine.max_model_len, engine.vocab_size)
            for choice in expand_choices(params):
                requests.append((f"{base}-{len(requests)}", prompt, choice))
                prompt_of_choice.append(p)
        spec = requests[0][2].structured
        try:
            if spec is not None:  # compile off the engine thread; add_request hits the cache
                await asyncio.to_thread(engine.compile_grammar, spec)
            group = await async_engine.submit(requests)
        except ValueError as exc:  # GrammarError and the engine's InvalidParameter name the field
            raise APIError(400, str(exc), param=getattr(exc, "param", None)) from None
        except EngineError as exc:
            raise APIError(503, str(exc), type="server_error") from None
        builder = ResponseBuilder(kind, ("chatcmpl-" if kind == "chat" else "cmpl-") + base,
                                  [r[0] for r in requests], prompt_of_choice, engine.model_name,
                                  token_texts, requests[0][2].logprobs)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(stream(group, builder, include_usage), lambda: abort(group),
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await complete(request, group, builder)

    def abort(group: RequestGroup) -> None:
        """Abort the group's unfinished requests (idempotent; the group is not read after)."""
        if group.unfinished:
            metrics.finished.labels(finish_reason="abort").inc(len(group.unfinished))
            async_engine.abort(group.unfinished)
            group.unfinished.clear()

    async def stream(group: RequestGroup, builder: ResponseBuilder, include_usage: bool):
        try:
            for payload in builder.first_chunks():
                yield _sse(payload)
            async for out in group:
                payload = builder.chunk(out)
                if payload is not None:
                    yield _sse(payload)
                if out.finished:
                    metrics.finished.labels(finish_reason=str(out.finish_reason)).inc()
            if include_usage:
                yield _sse(builder.usage_chunk())
        except EngineError as exc:
            yield _sse(APIError(500, str(exc), type="server_error").body.model_dump_json())
        finally:
            abort(group)  # client gone (or failure): free the engine's requests
        yield "data: [DONE]\n\n"

    async def complete(request: Request, group: RequestGroup, builder: ResponseBuilder) -> Response:
        async def collect() -> None:
            async for out in group:
                builder.add(out)
                if out.finished:
                    metrics.finished.labels(finish_reason=str(out.finish_reason)).inc()

        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            collector.cancel()
            abort(group)
        if not collector.done() or collector.cancelled():  # client disconnected: nobody to answer
            return Response(status_code=499)
        if isinstance(collector.exception(), EngineError):
            raise APIError(500, str(collector.exception()), type="server_error")
        collector.result()
        return _json(builder.response())

    return app
