"""Load: 64 concurrent streaming users for 60 s against ``dspark-serve serve`` (a real server
process with the default model and DSpark, loopback only), run twice with the same workload.

Every response must be well-formed (a complete SSE stream ending in ``[DONE]`` with exactly one
finish reason, a complete JSON body, or a 4xx OpenAI error for the deliberately bad requests),
there is no 5xx, every KV slot is free after each run, and the server's RSS after the second run
is within 10 % of its RSS after the first (no per-request memory growth). Run with ``-m load``.
"""
from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.load, pytest.mark.slow]

USERS = 64
RUN_S = 60.0
DRAIN_S = 240.0  # in-flight requests must finish within this after the run (bounded)
COST_TABLE = {"sample_batch_tokens": [1, 16, 64, 256],
              "sample_steps_per_sec": [10.0, 9.0, 6.0, 2.0], "max_batch_tokens": 256}
PROMPTS = ["Tell me a joke.", "What is 17 * 23?", "Name a river in Africa.",
           "Write one line of Python.", "Why is the sky blue?", "Say hello in French."]
FINISH = {"stop", "length"}
# Each user walks this cycle of actions from its own offset: deterministic and identical in
# both runs (up to where the 60 s end it).
KINDS = ["stream"] * 14 + ["abort"] * 2 + ["plain"] * 3 + ["bad"]


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """``dspark-serve serve`` on a free loopback port: yields (base url, pid)."""
    table = tmp_path_factory.mktemp("load") / "cost_table.json"
    table.write_text(json.dumps(COST_TABLE))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(table.parent / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "dspark_serve.cli", "serve",
                             "--host", "127.0.0.1", "--port", str(port), "--cost-table", str(table),
                             "--max-model-len", "512", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, Path(log.name).read_text()[-3000:]
        assert time.monotonic() < deadline, "server did not start"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    yield url, proc.pid
    proc.terminate()
    proc.wait(30)
    log.close()


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024


def gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def request_for(rng: random.Random, kind: str) -> tuple[str, dict]:
    """(path, body) of one user action of ``kind``: stream, abort, plain or bad."""
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    body = {"messages": messages, "max_tokens": rng.randint(4, 24),
            "temperature": rng.choice([0.0, 0.7, 1.0]), "stream": kind in ("stream", "abort")}
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 1000)
    if rng.random() < 0.2:
        body["stop"] = ["."]
    if kind == "bad":
        body = rng.choice([{"messages": []}, {"messages": messages, "max_tokens": -3},
                           {"messages": messages, "temperature": "hot"}])
    return "/v1/chat/completions", body


async def check_stream(response: httpx.Response, abort: bool) -> None:
    finishes, done, text = [], False, ""
    async for line in response.aiter_lines():
        if not line:
            continue
        assert line.startswith("data: ") and not done, line
        if line == "data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[len("data: "):])
        assert chunk["object"] == "chat.completion.chunk" and "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text += choice["delta"].get("content") or ""
            if choice["finish_reason"] is not None:
                finishes.append(choice["finish_reason"])
        if abort and text:
            return  # leaving the context manager drops the connection
    assert done and len(finishes) == 1 and finishes[0] in FINISH, (done, finishes)


async def user(client: httpx.AsyncClient, url: str, seed: int, deadline: float,
               tally: collections.Counter) -> None:
    rng, step = random.Random(seed), seed
    while time.monotonic() < deadline:
        kind = KINDS[step % len(KINDS)]
        step += 1
        path, body = request_for(rng, kind)
        async with client.stream("POST", url + path, json=body) as r:
            tally[f"status_{r.status_code // 100}xx"] += 1
            if kind == "bad":
                assert 400 <= r.status_code < 500, r.status_code
                assert json.loads(await r.aread())["error"]["message"]
            elif kind == "plain":
                assert r.status_code == 200, await r.aread()
                out = json.loads(await r.aread())
                assert out["choices"][0]["finish_reason"] in FINISH
                assert isinstance(out["choices"][0]["message"]["content"], str)
                assert out["usage"]["completion_tokens"] <= body["max_tokens"]
            else:
                assert r.status_code == 200, await r.aread()
                await check_stream(r, abort=kind == "abort")
        tally[kind] += 1


async def run_load(url: str) -> collections.Counter:
    tally: collections.Counter = collections.Counter()
    limits = httpx.Limits(max_connections=USERS, max_keepalive_connections=USERS)
    async with httpx.AsyncClient(limits=limits, timeout=DRAIN_S) as client:
        deadline = time.monotonic() + RUN_S
        await asyncio.wait_for(
            asyncio.gather(*(user(client, url, seed, deadline, tally) for seed in range(USERS))),
            RUN_S + DRAIN_S)
    return tally


def settle(url: str, initial_kv: float) -> None:
    """Wait until every KV slot is free again and the engine reports itself idle (the gauges
    are refreshed after aborts too, without another request driving a step)."""
    deadline = time.monotonic() + 60
    while True:
        if (gauge(url, "dspark_kv_free_tokens") == initial_kv
                and gauge(url, "dspark_num_requests_running") == 0
                and gauge(url, "dspark_num_requests_waiting") == 0):
            return
        assert time.monotonic() < deadline, "KV slots still held after the load"
        time.sleep(1.0)


def test_64_streaming_users_for_60_s_twice(server_process):
    url, pid = server_process
    httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    initial_kv = gauge(url, "dspark_kv_free_tokens")
    rss = []
    for run in range(2):
        tally = asyncio.run(run_load(url))
        assert tally["status_5xx"] == 0, tally
        assert all(tally[k] for k in KINDS), tally
        settle(url, initial_kv)
        rss.append(rss_bytes(pid))
        print(f"load run {run + 1}: {dict(tally)}, server RSS {rss[-1] >> 20} MiB")
    assert abs(rss[1] - rss[0]) <= 0.10 * rss[0], f"RSS {rss[0] >> 20} MiB -> {rss[1] >> 20} MiB"
