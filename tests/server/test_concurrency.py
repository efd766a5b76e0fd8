"""64 concurrent streaming clients (more than the engine runs at once): every stream is
well-formed and equals the same request made alone; nothing leaks."""
import asyncio
import json

import httpx

USERS = 64


def body(i, stream):
    return {"model": "fake-model", "prompt": f"user {i}", "max_tokens": 30, "seed": i,
            "stream": stream}


async def streamed_text(c, i):
    text, reasons = "", []
    async with c.stream("POST", "/v1/completions", json=body(i, True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                break
            ch = json.loads(line[6:])["choices"][0]
            text += ch["text"]
            reasons.append(ch["finish_reason"])
    assert reasons[-1] in ("stop", "length") and not any(reasons[:-1])
    return text


def test_64_concurrent_streams(make_fake_engine, serve_engine, wait_for):
    engine = make_fake_engine(max_num_seqs=8)
    with serve_engine(engine) as (url, app):
        with httpx.Client(base_url=url, timeout=30) as c:
            alone = [c.post("/v1/completions", json=body(i, False)).json()["choices"][0]["text"]
                     for i in range(USERS)]
        engine.step_delay = 0.001  # steps long enough for requests to queue up behind each other

        async def crowd():
            limits = httpx.Limits(max_connections=USERS)
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
                return await asyncio.gather(*(streamed_text(c, i) for i in range(USERS)))

        assert asyncio.run(crowd()) == alone
        assert wait_for(lambda: app.state.async_engine.num_in_flight == 0)
    assert engine.aborted == [] and engine.kv_free_tokens() == engine.KV_TOKENS
