"""Fixtures for the real-model engine tests (``test_llm_engine*.py``): engines of the default
model built once per module, MT-Bench chat prompts, a run-to-completion helper, and oracle
drafters.

The shipped default drafter is weakly trained (tau ~1.3), so on its own it rarely exercises
long accepted blocks. An oracle replaces the drafter's ``draft`` on one engine (undone after
the test) and proposes known continuations instead: one-hot blocks of a reference output with
corruptions at random positions (temperature 0 and seeded tests), or samples of a given draft
distribution (the temperature-1 lossless test). It also asserts the drafter-context invariant
every round: a slot's context holds exactly the positions before the anchor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from dspark_serve.scheduling.cost_table import CostTable
from dspark_serve.engine.config import EngineConfig
from dspark_serve.engine.llm_engine import LLMEngine
from dspark_serve.engine.outputs import SpecStats
from dspark_serve.engine.params import SamplingParams
from dspark_serve.types import DraftBlock

NUM_PROMPTS = 20
# A smooth cost model of this CPU (step time ~ 60 ms + 4 ms per target token, probed at every
# B): Algorithm 1 stops at the first local maximum of its throughput, so a table with cliffs
# (a coarse or noisy profile) can make it verify nothing.
MAX_BATCH_TOKENS = 512
COST_TABLE = CostTable.from_step_times(list(range(1, MAX_BATCH_TOKENS + 1)),
                                       [0.06 + 0.004 * b for b in range(1, MAX_BATCH_TOKENS + 1)],
                                       meta={"model": "linear CPU cost model (tests)"})


@dataclass
class Completion:
    """Everything a request produced: token ids, text, finish reason, per-step deltas."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    deltas: list[int] = field(default_factory=list)  # tokens committed per step
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def accepted_length(self) -> float:
        return self.stats.accepted_length


def generate(engine: LLMEngine, prompts: dict[str, list[int]],
             params: SamplingParams | dict[str, SamplingParams],
             step_stats: list | None = None) -> dict[str, Completion]:
    """Add every prompt (request id -> token ids), step until all finish, collect outputs
    (and the engine's StepStats into ``step_stats``). On an error the engine's requests are
    aborted, so a shared engine stays usable."""
    done = {rid: Completion() for rid in prompts}
    try:
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, params[rid] if isinstance(params, dict) else params)
        while engine.has_unfinished():
            for out in engine.step():
                c = done[out.request_id]
                c.token_ids += out.new_token_ids
                c.text += out.new_text
                c.deltas.append(len(out.new_token_ids))
                c.finish_reason = out.finish_reason
                c.stats = out.stats
    finally:
        for r in engine.waiting + engine.running:
            engine.abort_request(r.request_id)
        (step_stats if step_stats is not None else []).extend(engine.pop_step_stats())
    return done


@pytest.fixture(scope="module")
def make_engine(tmp_path_factory) -> Callable[..., LLMEngine]:
    """``make_engine(**EngineConfig fields)``: an engine of the default model with COST_TABLE
    (no start-up profiling), cached for the test module (freed after it: each engine holds
    the target, ~0.3 GB in bfloat16)."""
    table = tmp_path_factory.mktemp("engine") / "cost_table.json"
    COST_TABLE.save(str(table))
    engines: dict[tuple, LLMEngine] = {}

    def make(**fields) -> LLMEngine:
        key = tuple(sorted(fields.items()))
        if key not in engines:
            engines[key] = LLMEngine(EngineConfig(cost_table=str(table), **fields))
        return engines[key]

    return make


@pytest.fixture(scope="module")
def mtbench_prompts(make_engine) -> dict[str, list[int]]:
    """The first NUM_PROMPTS MT-Bench first turns in the target's chat template, by id."""
    from dspark_serve.data.prompt_sets import load_prompts

    tok = make_engine(speculative="none", max_num_seqs=8, max_model_len=512).tokenizer
    prompts = {}
    for i, text in enumerate(load_prompts("mtbench", NUM_PROMPTS)):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
        prompts[f"mt{i}"] = tok.encode(chat, add_special_tokens=False)
    return prompts


def _slot_requests(engine: LLMEngine, slots: torch.Tensor, anchors: torch.Tensor,
                   anchor_positions: torch.Tensor, cache) -> list:
    """The running request of each drafted slot; checks the anchor and the drafter context."""
    by_slot = {r.slot: r for r in engine.running}
    reqs = [by_slot[int(s)] for s in slots]
    for r, a, p in zip(reqs, anchors.tolist(), anchor_positions.tolist()):
        assert (a, p) == (r.anchor, r.num_tokens - 1)
    # Context = every committed position before the anchor; rejected drafts never enter it.
    assert cache.lengths[slots].tolist() == anchor_positions.tolist()
    return reqs


class ReferenceOracle:
    """Draft blocks copied from reference outputs (request id -> output token ids), each
    position replaced by a random other token with probability ``corrupt``; one-hot probs.
    Past the reference's end the block is random tokens. ``conf_logit`` is every position's
    confidence logit (the scheduler input)."""

    def __init__(self, engine: LLMEngine, references: dict[str, list[int]], corrupt: float,
                 seed: int, conf_logit: float = 2.0):
        self.engine, self.references = engine, references
        self.corrupt, self.conf_logit = corrupt, conf_logit
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, cache, slots, anchors, anchor_positions, sampling, uniforms) -> DraftBlock:
        gamma, vocab = uniforms.shape[1], self.engine.vocab_size
        reqs = _slot_requests(self.engine, slots, anchors, anchor_positions, cache)
        noise = torch.randint(1, vocab, (len(reqs), gamma), generator=self.generator)
        flip = torch.rand(len(reqs), gamma, generator=self.generator) < self.corrupt
        tokens = torch.empty(len(reqs), gamma, dtype=torch.int64)
        for i, r in enumerate(reqs):
            full = r.prompt_ids + self.references[r.request_id]
            start = r.num_tokens  # position of the first draft
            for k in range(gamma):
                ref = full[start + k] if start + k < len(full) else None
                if ref is None:
                    tokens[i, k] = noise[i, k]
                else:
                    tokens[i, k] = (ref + int(noise[i, k])) % vocab if flip[i, k] else ref
        probs = torch.nn.functional.one_hot(tokens, vocab).float()
        conf = torch.full((len(reqs), gamma), self.conf_logit)
        return DraftBlock(tokens.to(slots.device), probs.to(slots.device), conf.to(slots.device))


class DistributionOracle:
    """Draft blocks sampled token by token from ``draft_dist(prefix) -> [V] float32 probs``,
    where prefix is the request's output so far plus the block's earlier drafts."""

    def __init__(self, engine: LLMEngine, draft_dist: Callable[[tuple[int, ...]], torch.Tensor],
                 seed: int):
        self.engine, self.draft_dist = engine, draft_dist
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, cache, slots, anchors, anchor_positions, sampling, uniforms) -> DraftBlock:
        gamma = self.engine.gamma  # the speculator uses only the block's first gamma positions
        reqs = _slot_requests(self.engine, slots, anchors, anchor_positions, cache)
        tokens = torch.empty(len(reqs), gamma, dtype=torch.int64)
        probs = torch.empty(len(reqs), gamma, self.engine.vocab_size)
        for i, r in enumerate(reqs):
            prefix = tuple(r.output_ids)
            for k in range(gamma):
                probs[i, k] = self.draft_dist(prefix)
                tokens[i, k] = torch.multinomial(probs[i, k], 1, generator=self.generator)
                prefix += (int(tokens[i, k]),)
        conf = torch.full((len(reqs), gamma), 2.0)
        return DraftBlock(tokens.to(slots.device), probs.to(slots.device), conf.to(slots.device))


@pytest.fixture(name="generate", scope="session")
def generate_fixture():
    """``generate(engine, prompts, params)`` (module function of the same name)."""
    return generate


@pytest.fixture(name="reference_oracle", scope="session")
def reference_oracle_fixture():
    return ReferenceOracle


@pytest.fixture(name="distribution_oracle", scope="session")
def distribution_oracle_fixture():
    return DistributionOracle


@pytest.fixture
def use_oracle(monkeypatch) -> Callable[[LLMEngine, Callable], None]:
    """``use_oracle(engine, oracle)``: the engine drafts with ``oracle`` for this test, its
    scheduler starting afresh (the survival and drafting times of the real drafter, measured
    by earlier tests on the shared engine, say nothing about the oracle)."""

    def install(engine: LLMEngine, oracle: Callable) -> None:
        monkeypatch.setattr(engine.speculator.drafter, "draft", oracle)
        reset = getattr(engine.speculator.scheduler, "reset", None)
        if reset is not None:
            reset()

    return install
