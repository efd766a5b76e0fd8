"""The embedded engine on the real default model: speculative decoding gives exactly the
tokens of plain decoding (temperature 0 and seeded sampling) with the default (shipped)
drafter, and with oracle drafters that make blocks accepted, partially rejected and cut by
max_tokens, stop tokens, stop strings and EOS. Every run has 8 requests in flight."""
from __future__ import annotations

import statistics

import pytest
import torch

from dspark_serve.engine.config import EngineConfig
from dspark_serve.engine.llm_engine import LLMEngine
from dspark_serve.engine.params import SamplingParams
from dspark_serve.scheduling.async_scheduler import PROBE_INTERVAL
from tests.engine.conftest import COST_TABLE

pytestmark = pytest.mark.slow

REF_TOKENS = 32      # greedy reference length (oracle runs)
SHORT_TOKENS = 6     # default-drafter runs: whole blocks verified, few accepted
MAX_NUM_SEQS = 8
SPEC_MODES = [("dspark", "async"), ("dspark", "algorithm1"), ("dflash", "static")]
MODE_IDS = [f"{m}-{s}" for m, s in SPEC_MODES]


@pytest.fixture(scope="module")
def engine_for(make_engine):
    def get(speculative="none", scheduler="async"):
        return make_engine(speculative=speculative, scheduler=scheduler,
                           max_num_seqs=MAX_NUM_SEQS, max_model_len=512)
    return get


@pytest.fixture(scope="module")
def greedy_reference(engine_for, generate, mtbench_prompts):
    """Plain greedy decoding of the MT-Bench prompts, REF_TOKENS tokens each."""
    return generate(engine_for(), mtbench_prompts,
                    SamplingParams(temperature=0.0, max_tokens=REF_TOKENS))


@pytest.mark.parametrize("mode", SPEC_MODES, ids=MODE_IDS)
def test_greedy_default_drafter_equals_plain(mode, engine_for, generate, mtbench_prompts,
                                               greedy_reference):
    """The default drafter: whole blocks verified, mostly rejected, output unchanged."""
    engine = engine_for(*mode)
    steps = []
    out = generate(engine, mtbench_prompts, SamplingParams(temperature=0.0,
                                                           max_tokens=SHORT_TOKENS), steps)
    assert len(greedy_reference) >= 20
    for rid, ref in greedy_reference.items():
        assert out[rid].token_ids == ref.token_ids[:SHORT_TOKENS], rid
    # Drafts were verified (l_r > 0), not just skipped.
    assert sum(s.verify_tokens for s in steps) > sum(s.rounds for s in steps) > 0


@pytest.mark.parametrize("mode", SPEC_MODES, ids=MODE_IDS)
def test_greedy_oracle_drafter_equals_plain(mode, engine_for, generate, mtbench_prompts,
                                            greedy_reference, reference_oracle, use_oracle):
    """Blocks of the target's own greedy continuation with 15% corrupted positions: long
    accepted prefixes, partial rejections (KV rollback), context extension by several tokens."""
    engine = engine_for(*mode)
    refs = {rid: c.token_ids for rid, c in greedy_reference.items()}
    use_oracle(engine, reference_oracle(engine, refs, corrupt=0.15, seed=1))
    out = generate(engine, mtbench_prompts, SamplingParams(temperature=0.0,
                                                           max_tokens=REF_TOKENS))
    for rid, ref in greedy_reference.items():
        assert out[rid].token_ids == ref.token_ids, rid
        assert out[rid].finish_reason == ref.finish_reason, rid
    tau = statistics.mean(c.accepted_length for c in out.values())
    assert tau > 2.0, f"mean accepted length {tau:.2f}: blocks are not being accepted"
    assert any(max(c.deltas) > 2 for c in out.values())


@pytest.mark.parametrize("mode", [("ngram", "static"), ("ngram", "algorithm1"),
                                  ("ngram", "async"), ("hybrid", "algorithm1"),
                                  ("hybrid", "async")], ids=lambda m: "-".join(m))
def test_greedy_prompt_lookup_modes_equal_plain(mode, engine_for, generate, mtbench_prompts,
                                                 greedy_reference):
    """Prompt lookup alone and hybrid (lookup where a >= 3-token match exists, the shipped
    drafter elsewhere): greedy output unchanged, drafts verified and some accepted."""
    engine = engine_for(*mode)
    steps = []
    out = generate(engine, mtbench_prompts, SamplingParams(temperature=0.0,
                                                           max_tokens=REF_TOKENS), steps)
    for rid, ref in greedy_reference.items():
        assert out[rid].token_ids == ref.token_ids, rid
    assert sum(s.verify_tokens for s in steps) > sum(s.rounds for s in steps) > 0
    assert sum(s.accepted_tokens for s in steps) > 0


def test_greedy_hybrid_with_corpus_lookup_equals_plain(make_engine, generate, mtbench_prompts,
                                                      greedy_reference):
    """Hybrid with the shipped corpus beside prompt lookup (static: every draft verified):
    greedy output unchanged, corpus drafts verified and some of them accepted."""
    engine = make_engine(speculative="hybrid", scheduler="static", corpus="shipped",
                         max_num_seqs=MAX_NUM_SEQS, max_model_len=512)
    corpus = engine.speculator.corpus_survival
    out = generate(engine, mtbench_prompts, SamplingParams(temperature=0.0, max_tokens=REF_TOKENS))
    for rid, ref in greedy_reference.items():
        assert out[rid].token_ids == ref.token_ids, rid
    assert corpus.reached[:, 0].sum() > 0 and corpus.accepted[:, 0].sum() > 0


def test_a_corpus_that_is_not_there_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="has no corpus.npz"):
        LLMEngine(EngineConfig(speculative="hybrid", corpus=str(tmp_path), max_num_seqs=1,
                               max_model_len=64, cost_table=None, scheduler="static"))


def test_async_drafts_only_where_it_pays(engine_for, generate, mtbench_prompts,
                                        greedy_reference, monkeypatch):
    """Drafting that costs more than it can gain (10 s per draft against COST_TABLE's
    ~0.1 s steps): the async scheduler runs plain decode steps, drafting only while it has no
    survival history yet and then in probes at most once per PROBE_INTERVAL steps; output
    unchanged. The
    drafter's context catches up in one batch per drafted step, none in the others (the
    backlog's bound, tested in test_speculator, lifted)."""
    monkeypatch.setattr("dspark_serve.engine.speculator.MAX_PENDING_TOKENS", 1 << 30)
    engine = engine_for("dspark", "async")
    sched = engine.speculator.scheduler
    sched.reset()
    monkeypatch.setattr(sched, "_draft_overheads",
                        lambda num_requests: torch.full((sched.gamma,), 10.0, dtype=torch.float64))
    drafter = engine.speculator.drafter
    context_calls = []
    extend_context = drafter.extend_context
    monkeypatch.setattr(drafter, "extend_context",
                        lambda *args: context_calls.append(1) or extend_context(*args))
    steps = []
    out = generate(engine, mtbench_prompts, SamplingParams(temperature=0.0,
                                                           max_tokens=REF_TOKENS), steps)
    for rid, ref in greedy_reference.items():
        assert out[rid].token_ids == ref.token_ids, rid
    drafted = sum(s.rounds > 0 for s in steps)
    assert 2 <= drafted <= 2 + len(steps) // PROBE_INTERVAL, (drafted, len(steps))
    assert len(context_calls) == drafted
    assert all(s.verify_tokens == 0 and s.drafted_tokens == 0 for s in steps if not s.rounds)


def test_chunked_prefill_equals_whole_prompt_prefill(make_engine, generate, mtbench_prompts,
                                                     greedy_reference):
    """Prompts prefilled 16 tokens per step (steps whose chunks need no logits, chunks next to
    other requests' decode tokens) decode exactly as with whole-prompt prefill."""
    engine = make_engine(speculative="dspark", max_num_seqs=MAX_NUM_SEQS, max_model_len=512,
                         prefill_chunk=16)
    out = generate(engine, mtbench_prompts, SamplingParams(temperature=0.0,
                                                           max_tokens=REF_TOKENS))
    assert min(len(ids) for ids in mtbench_prompts.values()) > 16
    for rid, ref in greedy_reference.items():
        assert out[rid].token_ids == ref.token_ids, rid


def test_int4_target_speculative_equals_plain(make_engine, generate, mtbench_prompts,
                                             reference_oracle, use_oracle):
    """``quantization="int4"``: speculative greedy output equals plain greedy output of the
    same int4 target (oracle blocks, 15% corrupted). (How close int4 is to the float32
    model: ``test_target_model.test_default_model_int4_as_close_to_float32_as_bfloat16``.)"""
    prompts = dict(list(mtbench_prompts.items())[:MAX_NUM_SEQS])
    params = SamplingParams(temperature=0.0, max_tokens=REF_TOKENS)
    config = dict(quantization="int4", max_num_seqs=MAX_NUM_SEQS, max_model_len=512)
    plain = generate(make_engine(speculative="none", **config), prompts, params)
    engine = make_engine(speculative="dspark", **config)
    refs = {rid: c.token_ids for rid, c in plain.items()}
    use_oracle(engine, reference_oracle(engine, refs, corrupt=0.15, seed=3))
    out = generate(engine, prompts, params)
    for rid in prompts:
        assert out[rid].token_ids == plain[rid].token_ids, rid
    assert statistics.mean(c.accepted_length for c in out.values()) > 2.0


def test_engine_on_shared_target_weights_equals_plain(make_engine, generate, mtbench_prompts,
                                                      tmp_path):
    """An engine built on another engine's target weights (``target_weights``, as ``bench
    compare`` builds its configurations): the hybrid engine taps layers the plain one does
    not, reads the same tensors, and its greedy output equals the plain engine's."""
    prompts = dict(list(mtbench_prompts.items())[:2])
    params = SamplingParams(temperature=0.0, max_tokens=48)
    config = dict(quantization="int4", max_num_seqs=2, max_model_len=512)
    plain_engine = make_engine(speculative="none", **config)
    plain = generate(plain_engine, prompts, params)
    table = tmp_path / "cost_table.json"
    COST_TABLE.save(str(table))
    shared = LLMEngine(EngineConfig(speculative="hybrid", cost_table=str(table), **config),
                       target_weights=plain_engine.target.weights)
    assert shared.target.weights is plain_engine.target.weights
    assert shared.target.target_layer_ids and not plain_engine.target.target_layer_ids
    out = generate(shared, prompts, params)
    for rid in prompts:
        assert out[rid].token_ids == plain[rid].token_ids, rid


def test_seeded_sampling_equals_plain_across_batches(engine_for, generate, mtbench_prompts,
                                                     reference_oracle, use_oracle):
    """Seeded requests: the same tokens alone, in a batch with unseeded requests, and with
    speculation (oracle blocks of the seeded output, partly corrupted)."""
    ids = list(mtbench_prompts)[:6]
    seeded = {rid: SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, seed=1000 + i)
              for i, rid in enumerate(ids)}
    plain = engine_for()
    ref = generate(plain, {rid: mtbench_prompts[rid] for rid in ids}, seeded)
    alone = generate(plain, {ids[0]: mtbench_prompts[ids[0]]}, seeded)
    assert alone[ids[0]].token_ids == ref[ids[0]].token_ids
    assert len({tuple(c.token_ids) for c in ref.values()}) == len(ids)  # seeds matter

    engine = engine_for("dspark", "async")
    mixed = {rid: mtbench_prompts[rid] for rid in list(mtbench_prompts)[:8]}
    params = {rid: seeded.get(rid, SamplingParams(temperature=1.0, max_tokens=12))
              for rid in mixed}
    refs = {rid: (ref[rid].token_ids if rid in ref else []) for rid in mixed}
    use_oracle(engine, reference_oracle(engine, refs, corrupt=0.2, seed=2))
    out = generate(engine, mixed, params)
    for rid in ids:
        assert out[rid].token_ids == ref[rid].token_ids, rid
    tau = statistics.mean(out[rid].accepted_length for rid in ids)
    assert tau > 2.0, f"mean accepted length {tau:.2f}"


def _first_new(tokens: list[int], start: int, gamma: int) -> int:
    """Index >= start of the first token that does not occur earlier and is not the last
    token of a full block (index 8k with gamma 7: token 0 comes from the prefill)."""
    return next(j for j in range(start, len(tokens))
                if tokens[j] not in tokens[:j] and j % (gamma + 1))


def test_stops_inside_accepted_blocks(engine_for, generate, mtbench_prompts, greedy_reference,
                                      reference_oracle, use_oracle):
    """max_tokens, a stop token id, a stop string and EOS end a request exactly where plain
    decoding ends it. The oracle's blocks are uncorrupted and every block is verified whole
    (DFlash's static schedule, gamma 7), so each stop falls inside an accepted block whose
    later tokens must be dropped, and max_tokens cuts the last block short."""
    plain, engine = engine_for(), engine_for("dflash", "static")
    gamma, tok = engine.gamma, plain.tokenizer
    ids = list(mtbench_prompts)[:3]
    ref0, ref1, ref2 = (greedy_reference[rid].token_ids for rid in ids)
    j = _first_new(ref1, 9, gamma)
    stop_text = tok.decode(ref2[12:14])
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? One word."}],
        tokenize=False, add_generation_prompt=True)
    prompts = {**{rid: mtbench_prompts[rid] for rid in ids},
               "eos": tok.encode(chat, add_special_tokens=False)}
    params = {ids[0]: SamplingParams(temperature=0.0, max_tokens=11),
              ids[1]: SamplingParams(temperature=0.0, max_tokens=REF_TOKENS,
                                     stop_token_ids=[ref1[j]]),
              ids[2]: SamplingParams(temperature=0.0, max_tokens=REF_TOKENS, stop=[stop_text]),
              "eos": SamplingParams(temperature=0.0, max_tokens=REF_TOKENS)}
    expected = generate(plain, prompts, params)
    assert expected[ids[0]].token_ids == ref0[:11]
    assert expected[ids[1]].token_ids == ref1[:j + 1]
    eos_answer = expected["eos"].token_ids
    assert eos_answer[-1] in plain.eos_ids and (len(eos_answer) - 1) % (gamma + 1)
    assert [c.finish_reason for c in expected.values()] == ["length", "stop", "stop", "stop"]

    # Each oracle block runs on past the end (the EOS answer is followed by itself again).
    refs = {ids[0]: ref0, ids[1]: ref1, ids[2]: ref2, "eos": eos_answer + eos_answer}
    use_oracle(engine, reference_oracle(engine, refs, corrupt=0.0, seed=3))
    out = generate(engine, prompts, params)
    for rid, exp in expected.items():
        c = out[rid]
        assert (c.token_ids, c.text, c.finish_reason) == (exp.token_ids, exp.text,
                                                          exp.finish_reason), rid
        # Tokens the verify rounds produced (accepted drafts + one each) vs committed ones.
        produced = c.stats.accepted_tokens + c.stats.verify_rounds
        if rid == ids[0]:
            assert c.deltas == [1, gamma + 1, 2] and produced == 10
        else:
            assert produced > len(c.token_ids) - 1, f"{rid}: nothing past the stop was dropped"
