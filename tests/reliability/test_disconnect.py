"""Clients that disconnect mid-stream: each aborted request is freed (its KV slot and drafter
context return), the others are unaffected. After 50 aborted streams the engine's free KV
equals the initial free KV, also as reported by /metrics."""
from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow

ABORTED = 50
WAVE = 10
BYSTANDER = {"prompt": "The three primary colours are", "temperature": 0, "max_tokens": 40}


def abort_after_first_token(url: str, i: int) -> bool:
    """Open a stream, read until the first text arrives, then drop the connection."""
    body = {"prompt": f"Story number {i}: once upon a time", "max_tokens": 200,
            "temperature": 0.8, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                return True
    return False


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_aborted_streams_free_their_kv(server):
    server.wait_idle()
    aborts_before = metric(server, "dspark_requests_finished_total", '{finish_reason="abort"}')
    expected = server.complete(BYSTANDER)["choices"][0]["text"]
    bystander: dict = {}
    thread = threading.Thread(target=lambda: bystander.update(server.complete(BYSTANDER)))
    thread.start()
    with ThreadPoolExecutor(WAVE) as pool:
        got_text = list(pool.map(lambda i: abort_after_first_token(server.url, i), range(ABORTED)))
    thread.join()
    assert all(got_text)
    assert bystander["choices"][0]["text"] == expected
    server.wait_idle()
    assert server.engine.kv_free_tokens() == server.initial_kv
    assert not server.engine.running and not server.engine.waiting
    server.complete(BYSTANDER)  # one more step refreshes the KV gauge
    assert metric(server, "dspark_kv_free_tokens") == server.initial_kv
    aborts = metric(server, "dspark_requests_finished_total", '{finish_reason="abort"}')
    assert aborts - aborts_before == ABORTED
