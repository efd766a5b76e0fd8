"""Live embedded servers with the real default model (SmolLM2-135M) for the reliability tests.

Two uvicorn servers run in this process for the whole session, each over a real ``LLMEngine``:

- ``ref_server``: ``--speculative none`` (plain decoding, the reference);
- ``spec_server``: ``--speculative dspark`` with the async scheduler and a small cost table
  written here (no startup profile), whose drafter is wrapped by an ``OracleDrafter``.

The default drafter accepts little (tau ~1.3), which would make most "inside an accepted
block" cases rare. The oracle replays the target's own greedy
continuation, recorded from the reference server's finished temperature-0 requests, so blocks
really are accepted (up to gamma drafts plus the bonus token per round). It still runs the real
drafter first (its shapes and positions stay exercised, e.g. near the context limit) and only
overwrites the positions it knows. A server cannot be monkeypatched in a subprocess, hence the
in-process servers. The oracle and the ``Recorder`` live in ``oracle.py``; the recorder taps
the engines' public ``add_request``/``step`` to map each HTTP response to the exact token ids
and top logprobs the engine produced.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from dspark_serve.engine.config import EngineConfig


def _load_oracle_module():
    """``oracle.py`` beside this file (tests are imported in importlib mode: no package)."""
    spec = importlib.util.spec_from_file_location("reliability_oracle",
                                                  Path(__file__).with_name("oracle.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_oracle = _load_oracle_module()
OracleDrafter, Recorder = _oracle.OracleDrafter, _oracle.Recorder

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 12
# SPS falls slowly with the batch (SGLang cost table format): the async scheduler verifies
# every draft the oracle is confident about and skips the near-zero-survival ones.
COST_TABLE = {"sample_batch_tokens": [1, 8, 16, 32, 64, 128, 256],
              "sample_steps_per_sec": [10.0, 9.9, 9.6, 9.0, 8.0, 6.0, 3.5],
              "max_batch_tokens": 256}
HTTP_TIMEOUT_S = 300.0


@dataclass
class LiveServer:
    """One in-process server: ``url``, the real ``engine``, its ``recorder``, ``oracle``
    (None without speculation) and the app's Prometheus ``metrics``."""

    name: str
    url: str
    engine: object
    recorder: Recorder
    oracle: OracleDrafter | None
    metrics: object
    initial_kv: int = 0

    def __post_init__(self):
        self.initial_kv = self.engine.kv_free_tokens()

    def post(self, path: str, body) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, timeout=HTTP_TIMEOUT_S,
                          headers={"Content-Type": "application/json"})

    def complete(self, body: dict, path: str = "/v1/completions") -> dict:
        """POST and return the JSON body, failing the test on a non-200 answer."""
        r = self.post(path, body)
        assert r.status_code == 200, (self.name, r.status_code, r.text)
        return r.json()

    def complete_many(self, bodies: list[dict], concurrency: int,
                      path: str = "/v1/completions") -> list[dict]:
        """``complete`` over bodies with ``concurrency`` clients at a time, in body order."""
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda b: self.complete(b, path), bodies))

    def stream(self, body: dict, path: str = "/v1/chat/completions") -> tuple[str, list[dict]]:
        """POST with ``stream: true``; returns (the concatenated text of choice 0, every parsed
        chunk), failing the test on a non-200 answer or a stream without ``[DONE]``."""
        chunks, done = [], False
        with httpx.stream("POST", self.url + path, json={**body, "stream": True},
                          timeout=HTTP_TIMEOUT_S) as r:
            assert r.status_code == 200, (self.name, r.status_code, r.read())
            for line in r.iter_lines():
                if not line:
                    continue
                assert line.startswith("data: ") and not done, line
                if line == "data: [DONE]":
                    done = True
                else:
                    chunks.append(json.loads(line[len("data: "):]))
        assert done, f"{self.name}: stream ended without [DONE]"
        parts = [c["choices"][0]["delta"].get("content") or "" if "delta" in c["choices"][0]
                 else c["choices"][0]["text"] for c in chunks if c["choices"]]
        return "".join(parts), chunks

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Wait until the engine has no request left (aborts are processed asynchronously)."""
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished() or self.engine.kv_free_tokens() != self.initial_kv:
            assert time.monotonic() < deadline, f"{self.name}: engine still busy"
            time.sleep(0.05)


def _engine(speculative: str, tmp_path_factory):
    from dspark_serve.engine.llm_engine import LLMEngine

    cost_table = None
    if speculative != "none":
        cost_table = tmp_path_factory.mktemp("cost") / "cost_table.json"
        cost_table.write_text(json.dumps(COST_TABLE))
    # always_draft: these tests need accepted blocks; the real drafter's CPU time would often
    # make the async scheduler skip drafting against this cost table.
    return LLMEngine(EngineConfig(speculative=speculative, scheduler="async",
                                  always_draft=speculative != "none",
                                  cost_table=str(cost_table) if cost_table else None,
                                  max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, seed=0))


@pytest.fixture(scope="session")
def spec_server(tmp_path_factory, serve_engine):
    """DSpark server whose drafter is the ``OracleDrafter`` (learning from ``ref_server``)."""
    engine = _engine("dspark", tmp_path_factory)
    oracle = OracleDrafter(engine.speculator.drafter, engine)
    engine.speculator.drafter = oracle
    # Verify lengths from the cost table and confidences alone: the served drafting and step
    # times would make them depend on the host's speed (a CI host once verified 5 of a
    # round's 7 oracle drafts, and a stop meant to fall inside that block fell at its end).
    engine.speculator.scheduler.observe_draft = engine.speculator.scheduler.observe_step = None
    recorder = Recorder(engine)
    with serve_engine(engine) as (url, app):
        yield LiveServer("dspark", url, engine, recorder, oracle, app.state.metrics)


@pytest.fixture(scope="session")
def ref_server(tmp_path_factory, serve_engine, spec_server):
    """Plain-decoding server; its finished greedy requests teach the spec server's oracle."""
    engine = _engine("none", tmp_path_factory)
    recorder = Recorder(engine, on_greedy=spec_server.oracle.learn)
    with serve_engine(engine) as (url, app):
        yield LiveServer("none", url, engine, recorder, None, app.state.metrics)


@pytest.fixture(params=["none", "dspark"])
def server(request) -> LiveServer:
    """Each test once without and once with speculation."""
    return request.getfixturevalue("ref_server" if request.param == "none" else "spec_server")


@pytest.fixture
def oracle_mode(spec_server):
    """``with oracle_mode("mixed"): ...`` sets the spec server's oracle mode for a block."""
    @contextlib.contextmanager
    def use(mode: str):
        old, spec_server.oracle.mode = spec_server.oracle.mode, mode
        try:
            yield spec_server.oracle
        finally:
            spec_server.oracle.mode = old

    return use


@pytest.fixture
def nucleus():
    """``allowed_count`` of ``oracle.py`` (see its docstring) for tests."""
    return _oracle.allowed_count
