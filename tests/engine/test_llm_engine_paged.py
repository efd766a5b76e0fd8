"""The engine's paged KV pool on the real default model: the default configuration serves the
model's whole context, and a pool too small for its requests preempts and recomputes them
without changing a token, sharing a page or losing one."""
from __future__ import annotations

import pytest
import torch

from dspark_serve.engine.params import SamplingParams

pytestmark = pytest.mark.slow

LONG_PROMPT = 8000


def test_default_config_serves_an_8000_token_prompt(make_engine):
    """No flags: the context is the model's 8192 tokens, and an 8,000-token prompt (refused by
    the former 2048-token slots) is admitted with pages for itself, its first token and a
    draft block, prefilled chunk by chunk next to a short request, and its pages come back
    on abort. (The whole prefill takes minutes on a 2-core CPU, so it stops after two
    chunks.)"""
    engine = make_engine()
    kv = engine.kv
    assert engine.max_model_len == 8192
    assert kv.capacity_tokens == engine.kv_free_tokens() == 16 * 2048
    prompt = torch.randint(100, 20000, (LONG_PROMPT,), generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("long", prompt.tolist(), greedy)
    engine.add_request("short", prompt[:30].tolist(), greedy)
    for _ in range(2):
        engine.step()
    long, short = engine.running
    assert (long.request_id, long.num_computed) == ("long", 2 * engine.config.prefill_chunk)
    assert kv.reserved_tokens(long.slot) >= LONG_PROMPT + 1 + engine.gamma
    assert not set(kv.pages_of(long.slot)) & set(kv.pages_of(short.slot))
    engine.abort_request("long")
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_free_tokens() == kv.capacity_tokens


def _run_checking_pages(engine, prompts, params) -> tuple[dict[str, list[int]], set[int]]:
    """Run to completion; after every step no page belongs to two running requests and
    every page is either held or free. Returns the outputs and the pages ever held."""
    out = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params[rid])
    used: set[int] = set()
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        held = [p for r in engine.running for p in engine.kv.pages_of(r.slot)]
        assert len(held) == len(set(held))
        assert len(held) + engine.kv.num_free_pages == engine.kv.num_pages
        used.update(held)
    return out, used


@pytest.mark.parametrize("speculative", ["none", "dspark"])
def test_out_of_pages_preempts_and_recomputes(speculative, make_engine, mtbench_prompts):
    """A 256-position pool (4 pages) for 6 requests of mixed lengths that together need far
    more: the newest running requests are preempted and recomputed, the greedy and seeded
    outputs equal those of a pool that never runs out, every page gets reused, and all pages
    are free at the end."""
    prompts = dict(list(mtbench_prompts.items())[:6])
    lengths = [12, 60, 5, 40, 80, 24]
    params = {rid: SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=n,
                                  ignore_eos=True)
              for i, (rid, n) in enumerate(zip(prompts, lengths))}
    sizes = dict(max_num_seqs=4, max_model_len=256)
    reference, _ = _run_checking_pages(make_engine(speculative="none", **sizes), prompts, params)
    engine = make_engine(speculative=speculative, scheduler="static", kv_cache_tokens=256,
                         **sizes)
    before = engine.num_preemptions
    out, used = _run_checking_pages(engine, prompts, params)
    assert out == reference
    assert [len(out[rid]) for rid in prompts] == lengths
    assert engine.num_preemptions > before
    assert used == set(range(engine.kv.num_pages)) and engine.kv.num_pages == 4
    assert engine.kv.num_free_pages == 4 and engine.kv_free_tokens() == 256


def test_requests_done_at_their_first_token_free_their_slots(make_engine):
    """More max_tokens=1 requests than slots: each finishes in the step that completes its
    prompt and frees its slot and pages there, so the queue drains (a plan that re-read
    "prompt completes this step" after committing left them running forever)."""
    engine = make_engine(speculative="none", max_num_seqs=2, max_model_len=64)
    for i in range(5):
        engine.add_request(str(i), [100 + i] * (3 + i),
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    steps = 0
    while engine.has_unfinished() and steps < 10:
        engine.step()
        steps += 1
    assert not engine.has_unfinished() and steps == 3
    assert engine.kv.num_free_slots == 2 and engine.kv.num_free_pages == engine.kv.num_pages
