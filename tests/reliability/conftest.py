"""Live embedded servers with the real default model (SmolLM2-135M) for the reliability tests.

Two uvicorn servers run in this process for the whole session, each over a real ``LLMEngine``:

- ``ref_server``: ``--speculative none`` (plain decoding, the reference);
- ``spec_server``: ``--speculative dspark`` with the async scheduler and a small cost table
  written here (no startup profile), whose drafter is wrapped by an ``OracleDrafter``.

The default drafter is untrained and accepts almost nothing, which would make every
"inside an accepted block" case vacuous. The oracle replays the target's own greedy
continuation, recorded from the reference server's finished temperature-0 requests, so blocks
really are accepted (up to gamma drafts plus the bonus token per round). It still runs the real
drafter first (its shapes and positions stay exercised, e.g. near the context limit) and only
overwrites the positions it knows. A server cannot be monkeypatched in a subprocess, hence the
in-process servers. ``Recorder`` taps the engines' public ``add_request``/``step`` to map each
HTTP response to the exact token ids and top logprobs the engine produced.
"""
from __future__ import annotations

import contextlib
import json
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
import torch
import uvicorn

from dspark_serve.engine.config import EngineConfig
from dspark_serve.engine.outputs import RequestFailed
from dspark_serve.server.app import create_app
from dspark_serve.types import DraftBlock

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 12
# SPS falls slowly with the batch (SGLang cost table format): the async scheduler verifies
# every draft the oracle is confident about and skips the near-zero-survival ones.
COST_TABLE = {"sample_batch_tokens": [1, 8, 16, 32, 64, 128, 256],
              "sample_steps_per_sec": [10.0, 9.9, 9.6, 9.0, 8.0, 6.0, 3.5],
              "max_batch_tokens": 256}
KNOWN_LOGIT = 8.0     # confidence logit of a position the oracle knows (survival ~1)
UNKNOWN_LOGIT = -8.0  # ... of the real drafter's guesses (almost never verified)
HTTP_TIMEOUT_S = 300.0


def allowed_count(ranked: list[tuple[int, float]], top_k: int, top_p: float, min_p: float,
                  tol: float = 1e-4) -> int | None:
    """How many of the most probable tokens survive top-k / top-p / min-p warping at
    temperature 1 (each filter on the raw distribution; use one filter at a time).

    Args:
        ranked: (token id, raw target logprob) pairs, most probable first (a top-N list).
        tol: probability slack in favour of keeping a token near a cut-off (the reference and
            the engine under test compute the logits in different batch shapes).
    Returns:
        the count, or None when the nucleus reaches past the end of ``ranked``.
    """
    probs = [math.exp(lp) for _, lp in ranked]
    n = len(probs)
    if top_k:
        n = min(n, sum(p >= probs[min(top_k, len(probs)) - 1] - tol for p in probs))
    if top_p < 1.0:
        cum, keep = 0.0, 0
        while keep < len(probs) and cum < top_p + tol:
            cum += probs[keep]
            keep += 1
        if cum < top_p - tol and keep == len(probs):
            return None
        n = min(n, keep)
    if min_p:
        n = min(n, sum(p >= min_p * probs[0] - tol for p in probs))
    return n


class OracleDrafter:
    """The engine's drafter with its blocks overwritten by recorded target continuations.

    Modes (``mode``):
        "greedy": propose the recorded greedy continuation (up to gamma tokens), one-hot
            draft probabilities, confidence ``KNOWN_LOGIT``; unknown positions keep the real
            drafter's tokens with ``UNKNOWN_LOGIT``.
        "mixed": as greedy, but keep only the first ``(len(history) * 5 + anchor) % (gamma + 1)``
            known tokens and give the next position confidence 0 (survival 1/2), so rounds end
            in partial acceptance and rejections, deterministically per history.
        "adversarial": propose, at the first position, the most probable recorded target token
            that the row's top-k / top-p / min-p filters exclude (a lossless verifier must
            never emit it).
        "off": the real drafter's block unchanged.
    Every proposal is a one-hot draft distribution that the token was really drawn from, so
    verification stays lossless whatever the oracle proposes.
    """

    def __init__(self, drafter, engine):
        self.drafter = drafter
        self.engine = engine
        self.mode = "greedy"
        self.proposed = 0  # tokens proposed from recordings so far (all modes)
        self.next_token: dict[tuple[int, ...], int] = {}
        self.ranked: dict[tuple[int, ...], list[tuple[int, float]]] = {}

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def learn(self, prompt_ids: list[int], output_ids: list[int],
              top_logprobs: list[dict[int, float]], overwrite: bool = True) -> None:
        """Record a finished request's continuation (with ``overwrite``, later recordings of a
        history win; without, earlier ones, e.g. greedy over sampled)."""
        seq = list(prompt_ids) + list(output_ids)
        for i, token in enumerate(output_ids):
            key = tuple(seq[:len(prompt_ids) + i])
            if overwrite or key not in self.next_token:
                self.next_token[key] = token
            if i < len(top_logprobs) and top_logprobs[i]:
                self.ranked[key] = sorted(top_logprobs[i].items(), key=lambda kv: -kv[1])

    def _proposal(self, history: list[int], top_k: int, top_p: float, min_p: float) -> list[int]:
        gamma = self.drafter.gamma
        if self.mode == "adversarial":
            ranked = self.ranked.get(tuple(history))
            keep = allowed_count(ranked, top_k, top_p, min_p) if ranked else None
            return [ranked[keep][0]] if keep is not None and keep < len(ranked) else []
        out, seq = [], list(history)
        while len(out) < gamma and (t := self.next_token.get(tuple(seq))) is not None:
            out.append(t)
            seq.append(t)
        if self.mode == "mixed":
            out = out[:(len(history) * 5 + history[-1]) % (gamma + 1)]
        return out

    def draft(self, cache, slots, anchor_tokens, anchor_positions, sampling, uniforms) -> DraftBlock:
        block = self.drafter.draft(cache, slots, anchor_tokens, anchor_positions, sampling,
                                   uniforms)
        if self.mode == "off":
            return block
        tokens, probs = block.tokens.clone(), block.probs.clone()
        conf = torch.full_like(block.conf_logits, UNKNOWN_LOGIT)
        by_slot = {r.slot: r for r in self.engine.running}  # called inside engine.step()
        for i, slot in enumerate(slots.tolist()):
            req = by_slot[slot]
            history = req.prompt_ids + req.output_ids
            assert len(history) == int(anchor_positions[i]) + 1
            proposal = self._proposal(history, int(sampling.top_k[i]), float(sampling.top_p[i]),
                                      float(sampling.min_p[i]))
            self.proposed += len(proposal)
            for k, t in enumerate(proposal):
                tokens[i, k] = t
                probs[i, k] = 0.0
                probs[i, k, t] = 1.0
                conf[i, k] = KNOWN_LOGIT
            if self.mode == "mixed" and len(proposal) < tokens.shape[1]:
                conf[i, len(proposal)] = 0.0
        return DraftBlock(tokens, probs, conf)


class Recorder:
    """Wraps an engine's ``add_request`` and ``step`` to keep, per engine request id, the prompt,
    params, committed token ids and top logprobs; finished greedy requests go to ``on_greedy``."""

    def __init__(self, engine, on_greedy=None):
        self.prompts: dict[str, list[int]] = {}
        self.params: dict[str, object] = {}
        self.tokens: dict[str, list[int]] = {}
        self.top: dict[str, list[dict[int, float]]] = {}
        self.finish: dict[str, str] = {}
        self.on_greedy = on_greedy
        add, step = engine.add_request, engine.step

        def add_request(request_id, prompt_token_ids, params):
            add(request_id, prompt_token_ids, params)
            self.prompts[request_id] = list(prompt_token_ids)
            self.params[request_id] = params
            self.tokens[request_id], self.top[request_id] = [], []

        def recorded_step():
            try:
                outputs = step()
            except RequestFailed as exc:
                self._record(exc.outputs)
                raise
            self._record(outputs)
            return outputs

        engine.add_request, engine.step = add_request, recorded_step

    def _record(self, outputs) -> None:
        for out in outputs:
            rid = out.request_id
            self.tokens[rid] += out.new_token_ids
            self.top[rid] += out.new_top_logprobs or [{} for _ in out.new_token_ids]
            if out.finished:
                self.finish[rid] = out.finish_reason
                if self.on_greedy is not None and self.params[rid].temperature == 0:
                    self.on_greedy(self.prompts[rid], self.tokens[rid], self.top[rid])

    def request_ids(self, body: dict) -> list[str]:
        """Engine request ids of a (single-prompt) response's choices, in choice order."""
        base = body["id"].split("-", 1)[1]
        return [f"{base}-{i}" for i in range(len(body["choices"]))]

    def choice_tokens(self, body: dict) -> list[list[int]]:
        return [self.tokens[rid] for rid in self.request_ids(body)]

    def choice_prompt(self, body: dict) -> list[int]:
        return self.prompts[self.request_ids(body)[0]]


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


@dataclass
class _Running:
    server: uvicorn.Server
    thread: threading.Thread
    sock: socket.socket


def _start(engine) -> tuple[str, object, _Running]:
    app = create_app(engine)
    # IPPROTO_TCP makes asyncio set TCP_NODELAY (no Nagle + delayed-ACK stalls on keep-alive)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", app, _Running(server, thread, sock)


def _stop(running: _Running) -> None:
    running.server.should_exit = True
    running.thread.join(30)
    running.sock.close()


def _engine(speculative: str, tmp_path_factory):
    from dspark_serve.engine.llm_engine import LLMEngine

    cost_table = None
    if speculative != "none":
        cost_table = tmp_path_factory.mktemp("cost") / "cost_table.json"
        cost_table.write_text(json.dumps(COST_TABLE))
    return LLMEngine(EngineConfig(speculative=speculative, scheduler="async",
                                  cost_table=str(cost_table) if cost_table else None,
                                  max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, seed=0))


@pytest.fixture(scope="session")
def spec_server(tmp_path_factory):
    """DSpark server whose drafter is the ``OracleDrafter`` (learning from ``ref_server``)."""
    engine = _engine("dspark", tmp_path_factory)
    oracle = OracleDrafter(engine.speculator.drafter, engine)
    engine.speculator.drafter = oracle
    recorder = Recorder(engine)
    url, app, running = _start(engine)
    yield LiveServer("dspark", url, engine, recorder, oracle, app.state.metrics)
    _stop(running)


@pytest.fixture(scope="session")
def ref_server(tmp_path_factory, spec_server):
    """Plain-decoding server; its finished greedy requests teach the spec server's oracle."""
    engine = _engine("none", tmp_path_factory)
    recorder = Recorder(engine, on_greedy=spec_server.oracle.learn)
    url, app, running = _start(engine)
    yield LiveServer("none", url, engine, recorder, None, app.state.metrics)
    _stop(running)


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
    """``allowed_count`` (see its docstring) for tests."""
    return allowed_count
