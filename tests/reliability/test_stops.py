"""Where a request ends when a verify round commits several tokens at once: stop strings, stop
token ids and EOS inside an accepted block, max_tokens smaller than a round, and the context
limit. Each case runs on the plain server and on the DSpark server with the oracle drafter,
against the reference server's greedy output."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
PROMPT = "Describe a walk through a forest in autumn."
SHORT_PROMPT = "Is the sky blue? Answer with one word."
LONG_RUN = 28  # greedy tokens of the reference continuation


def chat(content: str, **params) -> dict:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **params}


@pytest.fixture(autouse=True)
def fresh_scheduler(spec_server):
    """Each case verifies as on a fresh server: the async scheduler sizes a round from the
    survival of earlier steps, so other tests' requests would move where blocks end (in the
    full suite the first round of a case once verified 2 of 7 oracle drafts)."""
    spec_server.wait_idle()
    spec_server.engine.speculator.scheduler.reset()


def overshoot(body: dict) -> int:
    """Tokens a speculative request verified past its end (and did not return): each verify
    round yields its accepted drafts plus one target token; the first completion token comes
    from the prefill step."""
    d = body["dspark"]
    return d["accepted_tokens"] + d["verify_rounds"] - (body["usage"]["completion_tokens"] - 1)


def stop_string(decode, ids: list[int], end: int, inside: bool) -> str:
    """A stop string that starts 3 characters before token ``end`` and ends inside it (one
    character short of its end) or at its end, and occurs nowhere earlier in the text."""
    before, through = decode(ids[:end]), decode(ids[:end + 1])
    assert len(through) - len(before) >= 2, "pick a token of two or more characters"
    stop = through[len(before) - 3:len(through) - inside]
    assert through.find(stop) == len(before) - 3, "the stop string occurs earlier"
    return stop


def check_result(server, body: dict, tokens: list[int], text: str, finish: str) -> None:
    """The response ends exactly after ``tokens`` (ids, text, logprobs and usage agree)."""
    choice = body["choices"][0]
    assert server.recorder.choice_tokens(body)[0] == tokens, server.name
    assert choice["message"]["content"] == text
    assert choice["finish_reason"] == finish
    assert body["usage"]["completion_tokens"] == len(tokens)
    if choice.get("logprobs") is not None:
        assert len(choice["logprobs"]["content"]) == len(tokens)


@pytest.fixture(scope="module")
def greedy(ref_server):
    """(token ids, decode function) of the reference's greedy continuation of PROMPT (which the
    oracle learns, so the spec server accepts whole blocks of it)."""
    body = ref_server.complete(chat(PROMPT, max_tokens=LONG_RUN, ignore_eos=True), CHAT)
    ids = ref_server.recorder.choice_tokens(body)[0]
    tok = ref_server.engine.tokenizer
    return ids, lambda t: tok.decode(t, skip_special_tokens=True)


@pytest.mark.parametrize("end", [9, 14, 19])
def test_stop_string_ending_inside_a_token(server, greedy, end):
    """A stop string that starts a few characters before token ``end`` and ends inside it:
    the text stops right before the stop string, nothing after token ``end`` is returned."""
    ids, decode = greedy
    before = decode(ids[:end])
    stop = stop_string(decode, ids, end, inside=True)
    body = server.complete(chat(PROMPT, max_tokens=LONG_RUN, stop=[stop], logprobs=True,
                                top_logprobs=2), CHAT)
    check_result(server, body, ids[:end + 1], before[:-3], "stop")
    streamed, chunks = server.stream(chat(PROMPT, max_tokens=LONG_RUN, stop=[stop]))
    assert streamed == before[:-3]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    if server.name == "dspark":
        assert overshoot(body) > 0, "the stop did not fall inside an accepted block"


def test_stop_token_id_inside_accepted_block(server, greedy):
    ids, decode = greedy
    k = next(i for i in range(10, LONG_RUN) if ids[i] not in ids[:i])
    body = server.complete(chat(PROMPT, max_tokens=LONG_RUN, stop_token_ids=[ids[k]],
                                logprobs=True), CHAT)
    check_result(server, body, ids[:k + 1], decode(ids[:k]), "stop")
    if server.name == "dspark":
        assert overshoot(body) > 0


def test_eos_inside_accepted_block(server, ref_server):
    """The reference first decodes past EOS (ignore_eos), so the oracle proposes blocks that run
    through EOS; without ignore_eos the request must end at EOS exactly."""
    past = ref_server.complete(chat(SHORT_PROMPT, max_tokens=16, ignore_eos=True), CHAT)
    ids = ref_server.recorder.choice_tokens(past)[0]
    eos = next(i for i, t in enumerate(ids) if t in ref_server.engine.eos_ids)
    assert eos + 4 < len(ids), "EOS must come early enough for a block to run past it"
    body = server.complete(chat(SHORT_PROMPT, max_tokens=16, logprobs=True), CHAT)
    text = ref_server.engine.tokenizer.decode(ids[:eos], skip_special_tokens=True)
    check_result(server, body, ids[:eos + 1], text, "stop")
    if server.name == "dspark":
        assert overshoot(body) > 0


@pytest.mark.parametrize("max_tokens", [3, 6])
def test_max_tokens_smaller_than_a_round(server, greedy, max_tokens):
    ids, decode = greedy
    body = server.complete(chat(PROMPT, max_tokens=max_tokens, logprobs=True), CHAT)
    check_result(server, body, ids[:max_tokens], decode(ids[:max_tokens]), "length")
    if server.name == "dspark":
        assert body["dspark"]["accepted_tokens"] > 0, "no block was accepted"


def test_stop_string_before_max_tokens_wins(server, greedy):
    """max_tokens ends the round at token 7; a stop string completing at token 4 wins."""
    ids, decode = greedy
    stop = stop_string(decode, ids, 4, inside=False)
    body = server.complete(chat(PROMPT, max_tokens=7, stop=[stop]), CHAT)
    check_result(server, body, ids[:5], decode(ids[:4])[:-3], "stop")


@pytest.fixture(scope="module")
def context_limit_prompt(ref_server):
    """A chat prompt leaving 30 tokens of room below max_model_len, and the reference's greedy
    completion that fills the context (taught to the oracle)."""
    tok, limit = ref_server.engine.tokenizer, ref_server.engine.max_model_len
    words = " ".join(f"w{i}" for i in range(400))
    lo, hi = 0, len(words)
    while lo < hi:  # longest prefix whose chat prompt leaves >= 30 tokens of room
        mid = (lo + hi + 1) // 2
        text = tok.apply_chat_template([{"role": "user", "content": "Continue: " + words[:mid]}],
                                       add_generation_prompt=True, tokenize=False)
        n = len(tok.encode(text, add_special_tokens=False))
        lo, hi = (mid, hi) if limit - n >= 30 else (lo, mid - 1)
    content = "Continue: " + words[:lo]
    body = ref_server.complete(chat(content, ignore_eos=True), CHAT)
    return content, body


def test_drafting_near_the_context_limit(server, context_limit_prompt, spec_server):
    """max_tokens defaults to the rest of the context: the request fills it and ends with
    "length"; the target never sees a position at or past max_model_len."""
    content, ref = context_limit_prompt
    limit = server.engine.max_model_len
    target = server.engine.target
    forward, positions = target.forward, []

    def recording_forward(input_ids, slots, pos, *args, **kwargs):
        positions.append(int(pos.max()))
        return forward(input_ids, slots, pos, *args, **kwargs)

    target.forward = recording_forward
    try:
        body = server.complete(chat(content, ignore_eos=True), CHAT)
    finally:
        del target.forward
    usage = body["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == limit
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert max(positions) == limit - 2  # the last token never needs K/V
    if server.name == "dspark":
        assert body["dspark"]["accepted_tokens"] >= usage["completion_tokens"] // 2
