"""Structured outputs in the embedded engine on the real default model: every output obeys its
grammar (replayed through a fresh matcher: no forbidden token, EOS only where the grammar may
end, JSON that validates against its schema) and speculative decoding returns exactly the
tokens of plain decoding under the same grammar, with drafts masked to the grammar and as
drafted, including the two public bug classes of speculative engines (a structured output cut
off at the first draft the grammar forbids; a grammar request taking the scheduler down)."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from dspark_serve.engine.params import SamplingParams
from dspark_serve.structured.spec import GrammarSpec, json_schema_spec, regex_spec
from dspark_serve.types import DraftBlock

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
MAX_NUM_SEQS = 8
SCHEMAS = {
    "person": {"type": "object", "required": ["name", "age"],
               "properties": {"name": {"type": "string", "maxLength": 16},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "verdict": {"type": "object", "required": ["answer", "reasons"],
                "properties": {"answer": {"enum": ["yes", "no"]},
                               "reasons": {"type": "array", "minItems": 1, "maxItems": 2,
                                           "items": {"type": "string", "maxLength": 12}}}},
    "city": {"type": "object", "required": ["city", "population"],
             "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                            "population": {"type": "integer"}}, "additionalProperties": False},
}
REGEX = r"(yes|no)\. [A-Z][a-z]{2,10}( [a-z]{2,10}){0,3}\."
QUESTIONS = {
    "person": "Give me a made-up person with a name and an age, as JSON.",
    "verdict": "Is the sky green? Answer as JSON with reasons.",
    "city": "Name a large city and its population, as JSON.",
    "object": "Describe a cat as a JSON object.",
    "regex": "Is water wet? Answer yes or no, then one short sentence.",
}


def spec_of(name: str) -> GrammarSpec:
    if name == "object":
        return GrammarSpec("json_object")
    return regex_spec(REGEX) if name == "regex" else json_schema_spec(SCHEMAS[name])


@pytest.fixture(scope="module")
def engines(make_engine):
    """plain, dspark with masked drafts, dspark with drafts verified as drafted (static
    scheduler: every drafted position is verified)."""
    sizes = dict(max_num_seqs=MAX_NUM_SEQS, max_model_len=256)
    return {"none": make_engine(speculative="none", **sizes),
            "masked": make_engine(speculative="dspark", scheduler="static", **sizes),
            "unmasked": make_engine(speculative="dspark", scheduler="static", mask_drafts=False,
                                    **sizes)}


@pytest.fixture(scope="module")
def prompts(engines) -> dict[str, list[int]]:
    """Two requests per grammar (request id "<grammar>-<k>"), plus two free-text requests."""
    tok = engines["none"].tokenizer
    out = {}
    for name, question in {**QUESTIONS, "text": "Write one sentence about GPUs."}.items():
        for k, suffix in enumerate(("", " Be brief.")):
            chat = tok.apply_chat_template([{"role": "user", "content": question + suffix}],
                                           tokenize=False, add_generation_prompt=True)
            out[f"{name}-{k}"] = tok.encode(chat, add_special_tokens=False)
    return out


def params_for(prompts, **kwargs) -> dict[str, SamplingParams]:
    return {rid: SamplingParams(max_tokens=MAX_TOKENS, **kwargs,
                                structured=None if rid.startswith("text") else
                                spec_of(rid.split("-")[0]))
            for rid in prompts}


def check_grammar(engine, rid: str, completion, params: SamplingParams) -> None:
    """The output replayed through a fresh matcher: every token allowed; "stop" exactly when
    the grammar accepted EOS; "length" only at max_tokens; JSON parses and validates."""
    spec = params.structured
    if spec is None:
        return
    state = engine.grammar_compiler().new_state(spec)
    for i, t in enumerate(completion.token_ids):
        assert state.accept(t), (rid, i, completion.text)
    if completion.finish_reason == "stop":
        assert state.terminated and completion.token_ids[-1] in engine.eos_ids, rid
        if spec.kind == "regex":
            return
        value = json.loads(completion.text)
        schema = json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}
        jsonschema.validate(value, schema)
    else:
        assert completion.finish_reason == "length", rid
        assert len(completion.token_ids) == params.max_tokens and not state.terminated, rid


@pytest.fixture(scope="module")
def greedy_plain(engines, generate, prompts):
    params = params_for(prompts, temperature=0.0)
    out = generate(engines["none"], prompts, params)
    for rid, c in out.items():
        check_grammar(engines["none"], rid, c, params[rid])
    return out


def test_plain_greedy_outputs_obey_their_grammars(greedy_plain):
    stopped = [rid for rid, c in greedy_plain.items() if c.finish_reason == "stop"]
    # most structured outputs complete within MAX_TOKENS (the schemas bound their strings)
    assert sum(not rid.startswith("text") for rid in stopped) >= 8, stopped


@pytest.mark.parametrize("mode", ["masked", "unmasked"])
def test_greedy_speculative_equals_plain(mode, engines, generate, prompts, greedy_plain,
                                         reference_oracle, use_oracle):
    """Oracle drafts: plain's own continuation with 30% of the positions replaced by random
    tokens (nearly all forbidden by the grammar), then random tokens past its end (after a
    drafted EOS too); grammar and free-text requests in one batch."""
    engine = engines[mode]
    refs = {rid: c.token_ids for rid, c in greedy_plain.items()}
    use_oracle(engine, reference_oracle(engine, refs, corrupt=0.3, seed=3))
    steps = []
    params = params_for(prompts, temperature=0.0)
    out = generate(engine, prompts, params, steps)
    for rid, ref in greedy_plain.items():
        assert (out[rid].token_ids, out[rid].finish_reason) == (ref.token_ids,
                                                                ref.finish_reason), rid
        check_grammar(engine, rid, out[rid], params[rid])
    json_rounds = sum(s.rounds_by_format.get("json", _zero()).verify_rounds for s in steps)
    json_accepted = sum(s.rounds_by_format.get("json", _zero()).accepted_tokens for s in steps)
    assert json_rounds > 0 and json_accepted / json_rounds > 1.0  # whole blocks accepted
    assert sum(s.grammar_seconds for s in steps) > 0


def _zero():
    from dspark_serve.engine.outputs import SpecStats
    return SpecStats()


def test_seeded_speculative_equals_plain(engines, generate, prompts, reference_oracle,
                                         use_oracle):
    """Temperature 1, seeded: replay sampling makes outputs identical token for token."""
    params = params_for(prompts, temperature=1.0, seed=11)
    plain = generate(engines["none"], prompts, params)
    engine = engines["masked"]
    refs = {rid: c.token_ids for rid, c in plain.items()}
    use_oracle(engine, reference_oracle(engine, refs, corrupt=0.3, seed=4))
    out = generate(engine, prompts, params)
    for rid, ref in plain.items():
        assert out[rid].token_ids == ref.token_ids, rid
        check_grammar(engine, rid, out[rid], params[rid])


@pytest.mark.parametrize("mode", ["none", "masked", "unmasked"])
def test_sampled_outputs_obey_their_grammars(mode, engines, generate, prompts):
    """Temperature 1, unseeded, the real (shipped) drafter, all requests at once."""
    params = params_for(prompts, temperature=1.0)
    out = generate(engines[mode], prompts, params)
    for rid, c in out.items():
        check_grammar(engines[mode], rid, c, params[rid])


def test_max_tokens_cuts_an_unfinished_grammar(engines, generate, prompts):
    params = params_for(prompts, temperature=0.0)
    for p in params.values():
        p.max_tokens = 5
    for mode in ("none", "masked"):
        out = generate(engines[mode], prompts, params)
        for rid, c in out.items():
            assert c.finish_reason == "length" and len(c.token_ids) == 5, (mode, rid)
            check_grammar(engines[mode], rid, c, params[rid])


def test_stop_string_cuts_an_unfinished_grammar(engines, generate, prompts, greedy_plain,
                                                reference_oracle, use_oracle):
    """A stop string inside the JSON ends the request there ("stop", text before the stop),
    with speculation exactly where plain decoding ends it."""
    ids = [rid for rid in prompts if rid.split("-")[0] in SCHEMAS]
    params = {rid: p for rid, p in params_for(prompts, temperature=0.0).items() if rid in ids}
    for p in params.values():
        p.stop = ['":']
    sub = {rid: prompts[rid] for rid in ids}
    plain = generate(engines["none"], sub, params)
    engine = engines["masked"]
    use_oracle(engine, reference_oracle(
        engine, {rid: greedy_plain[rid].token_ids for rid in ids}, corrupt=0.0, seed=5))
    spec = generate(engine, sub, params)
    for rid in ids:
        full = greedy_plain[rid].text
        assert plain[rid].finish_reason == "stop" and plain[rid].text == full[:full.index('":')]
        assert (spec[rid].token_ids, spec[rid].text) == (plain[rid].token_ids, plain[rid].text)
        state = engine.grammar_compiler().new_state(params[rid].structured)
        assert all(state.accept(t) for t in spec[rid].token_ids)


class ForbiddenDrafts:
    """Proposes, for every grammar request, the free-text greedy continuation of the same
    prompt (what an unconstrained drafter predicts: its first tokens are forbidden by the
    grammar), with confidence high enough that every position is verified."""

    def __init__(self, engine, free_text: dict[str, list[int]], prompts):
        self.engine, self.free_text = engine, free_text
        self.by_prompt = {tuple(prompts[rid]): rid for rid in free_text}

    def __call__(self, cache, slots, anchors, anchor_positions, sampling, uniforms):
        gamma, vocab = uniforms.shape[1], self.engine.vocab_size
        by_slot = {r.slot: r for r in self.engine.running}
        tokens = torch.full((len(slots), gamma), 2, dtype=torch.int64)  # EOS past the end
        for i, slot in enumerate(slots.tolist()):
            req = by_slot[slot]
            text = self.free_text[self.by_prompt[tuple(req.prompt_ids)]]
            cont = text[len(req.output_ids):len(req.output_ids) + gamma]
            tokens[i, :len(cont)] = torch.tensor(cont, dtype=torch.int64)
        probs = torch.nn.functional.one_hot(tokens, vocab).float()
        return DraftBlock(tokens, probs, torch.full((len(slots), gamma), 8.0))


@pytest.fixture(scope="module")
def free_text(engines, generate, prompts) -> dict[str, list[int]]:
    """Greedy outputs of every prompt without a grammar."""
    out = generate(engines["none"], prompts, SamplingParams(temperature=0.0,
                                                            max_tokens=MAX_TOKENS))
    return {rid: c.token_ids for rid, c in out.items()}


@pytest.mark.parametrize("mode", ["masked", "unmasked"])
def test_forbidden_drafts_do_not_truncate_or_crash(mode, engines, generate, prompts,
                                                   greedy_plain, free_text, use_oracle):
    """Regression for the two public bug classes: every draft of the grammar requests is
    forbidden or a premature EOS (sgl-project/sglang #9187: output cut at the first draft the
    grammar rejects; #24283 and openvinotoolkit/openvino.genai #4081: the scheduler crashing
    on masks after a rejected or stop-token draft). Outputs are the full plain outputs."""
    engine = engines[mode]
    grammar_ids = [rid for rid in prompts if not rid.startswith("text")]
    use_oracle(engine, ForbiddenDrafts(engine, free_text, prompts))
    steps = []
    params = params_for(prompts, temperature=0.0)
    out = generate(engine, prompts, params, steps)
    for rid in grammar_ids:
        assert out[rid].token_ids == greedy_plain[rid].token_ids, rid
        assert out[rid].finish_reason == greedy_plain[rid].finish_reason, rid
        check_grammar(engine, rid, out[rid], params[rid])
    assert sum(s.rounds_by_format["json"].verify_rounds for s in steps
               if "json" in s.rounds_by_format) > 0
