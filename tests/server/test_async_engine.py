"""AsyncEngine: one engine thread, grouped requests, rejection, failure isolation, shutdown."""
import asyncio

import pytest

from dspark_serve.engine.params import SamplingParams
from dspark_serve.server.async_engine import AsyncEngine, EngineError


def req(rid, prompt="hello", **kw):
    return rid, [ord(ch) for ch in prompt], SamplingParams(**{"max_tokens": 10, "seed": 1,
                                                              "ignore_eos": True, **kw})


async def drain(group):
    texts = {}
    async for out in group:
        texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
    return texts


def run_with(engine, coro_fn, stats=None):
    async def main():
        ae = AsyncEngine(engine, on_step_stats=(lambda s, kv, idle: stats.append((s, kv, idle)))
                         if stats is not None else None)
        ae.start()
        try:
            return await coro_fn(ae)
        finally:
            await asyncio.to_thread(ae.shutdown)
    return asyncio.run(main())


def test_groups_run_concurrently_and_complete(make_fake_engine):
    engine, stats = make_fake_engine(), []

    async def body(ae):
        g1 = await ae.submit([req("a"), req("b", seed=2)])
        g2 = await ae.submit([req("c", max_tokens=25)])
        return await asyncio.gather(drain(g1), drain(g2))

    t1, t2 = run_with(engine, body, stats)
    assert sorted(t1) == ["a", "b"] and sorted(t2) == ["c"]
    assert [len(t) for t in (t1["a"], t1["b"], t2["c"])] == [10, 10, 25]
    assert t1["a"] != t1["b"]
    assert not engine.has_unfinished() and engine.aborted == []
    steps = [s for batch, _, _ in stats for s in batch]
    assert sum(s.generated_tokens for s in steps) == 45
    assert stats[-1][1:] == (engine.KV_TOKENS, True)


def test_rejected_group_adds_nothing(make_fake_engine):
    engine = make_fake_engine()

    async def body(ae):
        with pytest.raises(ValueError, match="prompt too long"):
            await ae.submit([req("ok"), req("long", "x" * 300)])
        with pytest.raises(ValueError, match="duplicate request id"):
            await ae.submit([req("dup"), req("dup")])
        return await drain(await ae.submit([req("after")]))

    async def undisturbed(ae):
        return await drain(await ae.submit([req("after")]))

    assert run_with(engine, body) == run_with(make_fake_engine(), undisturbed)
    assert sorted(engine.aborted) == ["dup", "ok"]  # rolled back
    assert not engine.has_unfinished()


def test_request_failure_is_isolated(make_fake_engine):
    engine = make_fake_engine()

    async def body(ae):
        bad = await ae.submit([req("bad", "FAIL")])
        good = await ae.submit([req("good", max_tokens=30)])
        with pytest.raises(EngineError, match="injected failure"):
            await drain(bad)
        return await drain(good)

    assert len(run_with(engine, body)["good"]) == 30


def test_step_crash_fails_in_flight_and_thread_survives(make_fake_engine):
    engine = make_fake_engine(step_delay=0.001)

    async def body(ae):
        # "other" (>= 67 steps) is still running when the crashing request arrives
        groups = [await ae.submit([req("other", max_tokens=200)]),
                  await ae.submit([req("crash", "CRASH")])]
        for g in groups:
            with pytest.raises(EngineError, match="injected crash"):
                await drain(g)
        assert ae.alive
        return await drain(await ae.submit([req("next")]))

    assert len(run_with(engine, body)["next"]) == 10
    assert sorted(engine.aborted) == ["crash", "other"]


def test_abort_and_shutdown(make_fake_engine):
    engine = make_fake_engine(step_delay=0.001)

    async def body(ae):
        g = await ae.submit([req("long", max_tokens=200)])
        first = await g.__anext__()
        ae.abort(g.request_ids)
        while ae.num_in_flight:
            await asyncio.sleep(0.001)
        g2 = await ae.submit([req("cut", max_tokens=200)])
        await asyncio.to_thread(ae.shutdown)
        with pytest.raises(EngineError, match="shutting down"):
            await drain(g2)
        with pytest.raises(EngineError, match="not running"):
            await ae.submit([req("late")])
        return first

    first = run_with(engine, body)
    assert first.request_id == "long" and not first.finished
    assert engine.aborted == ["long", "cut"]
    assert engine.kv_free_tokens() == engine.KV_TOKENS
