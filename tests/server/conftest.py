"""A deterministic, instant fake of ``LLMEngine`` (same API) and a real uvicorn server on a
loopback port serving it, for the server tests."""
from __future__ import annotations

import collections
import random
import time
import zlib
from dataclasses import dataclass, field

import pytest
from jinja2 import TemplateError

from dspark_serve.engine.outputs import RequestFailed, RequestOutput, SpecStats, StepStats
from dspark_serve.engine.params import SamplingParams

EOS = 0
ALPHABET = [ord(c) for c in "abcdefghijklmnop "]
GAMMA = 4


class FakeTokenizer:
    """Character-level: token id = ASCII code (32..126), 0 = EOS (decodes to nothing)."""

    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) if 32 <= ord(c) < 127 else ord("?") for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if 32 <= i < 127)

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        if any(m["role"] == "system" for m in messages[1:]):
            raise TemplateError("System message must be first")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def token_logprob(t: int) -> float:
    return -(1 + t % 5) / 4


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    rng: random.Random
    out: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    stats: SpecStats = field(default_factory=SpecStats)


class FakeEngine:
    """Emits 1..3 tokens per request per step (like accepted drafts + bonus), drawn from a small
    alphabet by an RNG seeded from (seed, prompt), or from the prompt alone at temperature 0.
    Stop strings, stop ids, EOS, max_tokens and the context limit end requests like the real
    engine. A prompt containing FAIL fails alone (RequestFailed); CRASH makes step() raise."""

    model_name = "fake-model"
    max_model_len = 256
    vocab_size = 128
    KV_TOKENS = 4096

    def __init__(self, step_delay: float = 0.0, max_num_seqs: int = 8):
        self.tokenizer = FakeTokenizer()
        self.step_delay = step_delay
        self.max_num_seqs = max_num_seqs
        self.running: dict[str, _Req] = {}
        self.waiting: collections.deque[_Req] = collections.deque()
        self.added: list[str] = []
        self.added_params: dict[str, SamplingParams] = {}
        self.compiled: list = []  # GrammarSpecs passed to compile_grammar (never enforced)
        self.aborted: list[str] = []
        self._stats: list[StepStats] = []

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        if request_id in self.running or any(r.rid == request_id for r in self.waiting):
            raise ValueError(f"duplicate request id {request_id}")
        if len(prompt_token_ids) + 1 > self.max_model_len:
            raise ValueError("prompt too long")
        params.validate(self.vocab_size)
        key = zlib.crc32(bytes(t % 256 for t in prompt_token_ids))
        if params.temperature == 0:
            rng = random.Random(key)
        else:
            rng = random.Random(None if params.seed is None else params.seed * 1_000_003 + key)
        self.waiting.append(_Req(request_id, list(prompt_token_ids), params, rng))
        self.added.append(request_id)
        self.added_params[request_id] = params

    def compile_grammar(self, spec) -> None:
        self.compiled.append(spec)

    def abort_request(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is not None:
            self.aborted.append(request_id)
        for r in list(self.waiting):
            if r.rid == request_id:
                self.waiting.remove(r)
                self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def kv_free_tokens(self) -> int:
        return self.KV_TOKENS - sum(len(r.prompt) + len(r.out) for r in self.running.values())

    def pop_step_stats(self) -> list[StepStats]:
        stats, self._stats = self._stats, []
        return stats

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay)
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.popleft()
            self.running[r.rid] = r
        if any("CRASH" in self.tokenizer.decode(r.prompt) for r in self.running.values()):
            raise RuntimeError("injected crash")
        outputs, failed, step = [], None, StepStats(num_running=len(self.running))
        for r in list(self.running.values()):
            if "FAIL" in self.tokenizer.decode(r.prompt):
                failed = r.rid
                del self.running[r.rid]
                continue
            outputs.append(self._advance(r, step))
        step.num_waiting = len(self.waiting)
        self._stats.append(step)
        if failed is not None:
            raise RequestFailed(failed, "injected failure", outputs)
        return outputs

    def _advance(self, r: _Req, step: StepStats) -> RequestOutput:
        p = r.params
        k = 1 + r.stats.verify_rounds % 3  # 1, 2, 3, 1, ...: k - 1 accepted drafts + 1 bonus
        new, reason = [], None
        for _ in range(k):
            t = EOS if r.rng.random() < 0.02 else r.rng.choice(ALPHABET)
            new.append(t)
            r.out.append(t)
            r.text = self.tokenizer.decode(r.out)
            hits = [i for i in (r.text.find(s) for s in p.stop) if i >= 0]
            if hits:
                r.text, reason = r.text[:min(hits)], "stop"
            elif (t == EOS and not p.ignore_eos) or t in p.stop_token_ids:
                r.text, reason = self.tokenizer.decode(r.out[:-1]), "stop"  # stop token not in text
            elif len(r.out) >= p.max_tokens or len(r.prompt) + len(r.out) >= self.max_model_len:
                reason = "length"
            if reason:
                break
        acc = len(new) - 1
        r.stats.verify_rounds += 1
        r.stats.drafted_tokens += GAMMA
        r.stats.accepted_tokens += acc
        s = r.stats
        s.accepted_length = (s.accepted_tokens + s.verify_rounds) / s.verify_rounds
        step.rounds += 1
        step.drafted_tokens += GAMMA
        step.accepted_tokens += acc
        step.verify_tokens += GAMMA + 1
        step.generated_tokens += len(new)
        step.accepted_per_position = [a + (i < acc) for i, a in
                                      enumerate(step.accepted_per_position or [0] * GAMMA)]
        step.verified_per_position = [v + 1 for v in (step.verified_per_position or [0] * GAMMA)]
        # hold back a possible stop-string prefix until it is decided
        hold = 0 if reason else max((len(s) - 1 for s in p.stop), default=0)
        end = max(r.sent, len(r.text) - hold)
        delta, r.sent = r.text[r.sent:end], end
        if reason:
            del self.running[r.rid]
        return RequestOutput(
            request_id=r.rid, new_token_ids=new, new_text=delta,
            new_logprobs=[token_logprob(t) for t in new] if p.logprobs else None,
            new_top_logprobs=[{97 + j: -0.5 - j for j in range(p.top_logprobs)} for _ in new]
            if p.logprobs else None,
            finished=reason is not None, finish_reason=reason, prompt_tokens=len(r.prompt),
            completion_tokens=len(r.out),
            stats=SpecStats(r.stats.accepted_length, r.stats.verify_rounds,
                            r.stats.drafted_tokens, r.stats.accepted_tokens))


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture(scope="module")
def fake_server(serve_engine):
    """(base_url, FakeEngine, app): one server per test module, 1 ms per engine step."""
    engine = FakeEngine(step_delay=0.001)
    with serve_engine(engine) as (url, app):
        yield url, engine, app


@pytest.fixture
def make_fake_engine():
    return FakeEngine


@pytest.fixture
def wait_for():
    return wait_until
