"""A client that goes away has its engine requests aborted (KV returned), others unaffected;
an engine failure reaches only the requests it concerns and the server keeps serving."""
import threading

import httpx
import pytest

COMP, CHAT = "/v1/completions", "/v1/chat/completions"


def long_body(seed, **kw):
    # 250 tokens at 1..3 tokens per 1 ms step: far longer than reading one chunk
    return {"model": "fake-model", "prompt": "x", "max_tokens": 250, "ignore_eos": True,
            "seed": seed, **kw}


@pytest.fixture
def server(make_fake_engine, serve_engine):
    engine = make_fake_engine(step_delay=0.001)
    with serve_engine(engine) as (url, app):
        yield url, engine, app.state.async_engine


def idle(engine, async_engine):
    return async_engine.num_in_flight == 0 and not engine.has_unfinished()


def test_50_aborted_streams_return_all_kv(server, wait_for):
    url, engine, async_engine = server
    initial = engine.kv_free_tokens()
    # an unaffected request running alongside: its text must equal an undisturbed run
    with httpx.Client(base_url=url, timeout=30) as c:
        expected = c.post(COMP, json=long_body(999))
        assert expected.status_code == 200
    results = []
    bystander = threading.Thread(target=lambda: results.append(
        httpx.post(url + COMP, json=long_body(999), timeout=60)))
    bystander.start()
    with httpx.Client(base_url=url, timeout=30) as c:
        for i in range(50):
            path, body = (COMP, long_body(i)) if i % 2 else (CHAT, {
                **long_body(i), "prompt": None, "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 200})
            body = {k: v for k, v in body.items() if v is not None}
            with c.stream("POST", path, json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
            # leaving the block closes the connection mid-stream
    bystander.join(60)
    assert results[0].status_code == 200
    assert results[0].json()["choices"] == expected.json()["choices"]
    assert wait_for(lambda: idle(engine, async_engine))
    assert len(engine.aborted) == 50
    assert engine.kv_free_tokens() == initial == engine.KV_TOKENS
    assert async_engine.kv_free_tokens == initial
    metrics = httpx.get(url + "/metrics").text
    assert 'dspark_requests_finished_total{finish_reason="abort"} 50.0' in metrics


def test_non_streaming_disconnect_aborts(server, wait_for):
    url, engine, async_engine = server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + COMP, json=long_body(1, n=3), timeout=httpx.Timeout(5, read=0.05))
    assert wait_for(lambda: idle(engine, async_engine))
    assert len(engine.aborted) == 3 and sorted(engine.aborted) == sorted(engine.added)
    assert engine.kv_free_tokens() == engine.KV_TOKENS
    # the aborts left the engine idle without another step: the gauges must say so anyway
    metrics = httpx.get(url + "/metrics").text.splitlines()
    assert "dspark_num_requests_running 0.0" in metrics
    assert "dspark_num_requests_waiting 0.0" in metrics
    assert f"dspark_kv_free_tokens {float(engine.KV_TOKENS)}" in metrics
    assert httpx.post(url + COMP, json=long_body(2, max_tokens=5)).status_code == 200


def test_failed_request_is_isolated(server):
    url, engine, _ = server
    results = {}

    def run(name, prompt):
        results[name] = httpx.post(url + COMP, json=long_body(3, prompt=prompt, max_tokens=100),
                                   timeout=30)

    threads = [threading.Thread(target=run, args=("ok", "fine")),
               threading.Thread(target=run, args=("bad", "please FAIL"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results["ok"].status_code == 200
    assert results["ok"].json()["usage"]["completion_tokens"] == 100
    assert results["bad"].status_code == 500
    err = results["bad"].json()["error"]
    assert (err["type"], err["message"]) == ("server_error", "injected failure")


def test_engine_crash_fails_in_flight_then_recovers(server, wait_for):
    url, engine, async_engine = server
    with httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", COMP, json={**long_body(4, prompt="CRASH"), "stream": True}) as r:
            assert r.status_code == 200  # headers go out before the first step
            events = [line for line in r.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        assert '"type":"server_error"' in events[-2] and "injected crash" in events[-2]
        assert wait_for(lambda: idle(engine, async_engine))
        assert c.get("/health").status_code == 200
        ok = c.post(COMP, json=long_body(5, max_tokens=7))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 7
