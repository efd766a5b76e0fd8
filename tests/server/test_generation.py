"""Well-formed OpenAI bodies: streamed == non-streamed for the same seed, stop and finish
reasons propagate, n > 1, usage, logprobs shapes and the dspark statistics field."""
import json

import httpx
import pytest

from dspark_serve.engine.outputs import RequestOutput
from dspark_serve.server.responses import ResponseBuilder, TokenTexts

CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def client(fake_server):
    url, engine, _ = fake_server
    with httpx.Client(base_url=url, timeout=20) as c:
        yield c, engine


def chat(**kw):
    return {"model": "fake-model", "messages": [{"role": "user", "content": "tell me"}], **kw}


def comp(**kw):
    return {"model": "fake-model", "prompt": "once upon", **kw}


def sse_events(c, path, body):
    """Parsed SSE payloads of a streamed request; checks the framing and the final [DONE]."""
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert all(f.startswith("data: ") for f in frames[:-1])
    return [json.loads(f[len("data: "):]) for f in frames[:-2]]


def merge_stream(events, kind):
    """Per choice index: (text, finish_reason, logprobs entries); plus usage and dspark."""
    texts, finish, logprobs, usage, dspark = {}, {}, {}, None, {}
    for e in events:
        assert e["object"] == ("chat.completion.chunk" if kind == "chat" else "text_completion")
        if e.get("usage"):
            usage, dspark["all"] = e["usage"], e["dspark"]
        for ch in e["choices"]:
            i = ch["index"]
            piece = ch["delta"].get("content", "") if kind == "chat" else ch["text"]
            texts[i] = texts.get(i, "") + piece
            if ch["finish_reason"]:
                assert i not in finish, "one finish chunk per choice"
                finish[i] = ch["finish_reason"]
                dspark[i] = e["dspark"]
            if ch["logprobs"]:
                lp = ch["logprobs"]["content" if kind == "chat" else "token_logprobs"]
                logprobs.setdefault(i, []).extend(lp)
    return texts, finish, logprobs, usage, dspark


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("extra", [dict(seed=7, max_tokens=40), dict(temperature=0, max_tokens=30),
                                   dict(seed=3, n=3, max_tokens=25, ignore_eos=True)])
def test_stream_equals_non_stream(client, kind, extra):
    c, _ = client
    path, body = (CHAT, chat(**extra)) if kind == "chat" else (COMP, comp(**extra))
    body["stream_options"] = {"include_usage": True}
    events = sse_events(c, path, body)
    del body["stream_options"]
    full = c.post(path, json=body).json()
    texts, finish, _, usage, dspark = merge_stream(events, kind)
    n = extra.get("n", 1)
    assert len(full["choices"]) == n and sorted(texts) == list(range(n))
    for ch in full["choices"]:
        text = ch["message"]["content"] if kind == "chat" else ch["text"]
        assert texts[ch["index"]] == text and len(text) > 0
        assert finish[ch["index"]] == ch["finish_reason"]
    assert usage == full["usage"]
    assert dspark["all"] == full["dspark"]
    if kind == "chat":  # chat streams open each choice with the role
        roles = [e["choices"][0]["index"] for e in events if e["choices"]
                 and e["choices"][0]["delta"].get("role") == "assistant"]
        assert sorted(roles) == list(range(n))


def test_seeded_sampling_is_reproducible_and_seed_sensitive(client):
    c, _ = client
    a = c.post(CHAT, json=chat(seed=11, max_tokens=30)).json()["choices"][0]["message"]["content"]
    b = c.post(CHAT, json=chat(seed=11, max_tokens=30)).json()["choices"][0]["message"]["content"]
    d = c.post(CHAT, json=chat(seed=12, max_tokens=30)).json()["choices"][0]["message"]["content"]
    assert a == b and a != d


def test_n_choices_use_consecutive_seeds(client):
    c, _ = client
    many = c.post(COMP, json=comp(seed=100, n=3, max_tokens=20, ignore_eos=True)).json()
    singles = [c.post(COMP, json=comp(seed=100 + i, max_tokens=20, ignore_eos=True)).json()
               for i in range(3)]
    assert [ch["index"] for ch in many["choices"]] == [0, 1, 2]
    assert [ch["text"] for ch in many["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert len({ch["text"] for ch in many["choices"]}) == 3
    assert many["usage"] == {"prompt_tokens": 9, "completion_tokens": 60, "total_tokens": 69}


def test_prompt_list_times_n(client):
    c, _ = client
    r = c.post(COMP, json=comp(prompt=["ab", "cde", "hi"], n=2, max_tokens=4,
                               ignore_eos=True, seed=1)).json()
    assert [ch["index"] for ch in r["choices"]] == list(range(6))
    assert r["usage"] == {"prompt_tokens": 2 + 3 + 2, "completion_tokens": 24, "total_tokens": 31}
    # token-id prompts: [104, 105] is the string "hi"
    ids = c.post(COMP, json=comp(prompt=[[97, 98], [104, 105]], n=2, max_tokens=4,
                                 ignore_eos=True, seed=1)).json()
    assert [ch["text"] for ch in ids["choices"]] == [r["choices"][i]["text"] for i in (0, 1, 4, 5)]
    one = c.post(COMP, json=comp(prompt=[104, 105], max_tokens=4, ignore_eos=True, seed=1)).json()
    assert one["choices"][0]["text"] == r["choices"][4]["text"]
    # a list mixing strings and token ids is not an OpenAI prompt
    assert c.post(COMP, json=comp(prompt=["ab", [104]])).status_code == 400


def reference(c, seed):
    return c.post(COMP, json=comp(seed=seed, max_tokens=60, ignore_eos=True)).json()["choices"][0]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, stream):
    c, _ = client
    full = reference(c, 5)["text"]
    stop = full[20:23]
    cut = full.index(stop)
    body = comp(seed=5, max_tokens=60, ignore_eos=True, stop=["zzzz", stop])
    if stream:
        texts, finish, *_ = merge_stream(sse_events(c, COMP, body), "completion")
        text, reason = texts[0], finish[0]
    else:
        ch = c.post(COMP, json=body).json()["choices"][0]
        text, reason = ch["text"], ch["finish_reason"]
    assert (text, reason) == (full[:cut], "stop")


def test_stop_token_id_and_length(client):
    c, _ = client
    full = reference(c, 9)["text"]
    t = ord(full[10])
    ch = c.post(COMP, json=comp(seed=9, max_tokens=60, ignore_eos=True, stop_token_ids=[t])).json()
    assert (ch["choices"][0]["text"], ch["choices"][0]["finish_reason"]) == (
        full[:full.index(full[10])], "stop")
    ch = c.post(COMP, json=comp(seed=9, max_tokens=13, ignore_eos=True)).json()
    assert (ch["choices"][0]["text"], ch["choices"][0]["finish_reason"]) == (full[:13], "length")
    assert ch["usage"]["completion_tokens"] == 13


def test_eos_finishes_with_stop(client):
    c, _ = client
    # the fake emits EOS with probability 0.02 per token: about 70% of 60-token runs end early
    r = c.post(COMP, json=comp(seed=0, n=16, max_tokens=60)).json()
    reasons = [ch["finish_reason"] for ch in r["choices"]]
    assert set(reasons) == {"stop", "length"}
    assert all((len(ch["text"]) < 60) == (ch["finish_reason"] == "stop") for ch in r["choices"])


def test_default_max_tokens(client):
    c, _ = client
    r = c.post(COMP, json=comp(seed=1, ignore_eos=True)).json()
    assert r["usage"]["completion_tokens"] == 16  # OpenAI's completions default
    r = c.post(CHAT, json=chat(seed=1, ignore_eos=True)).json()
    assert r["usage"]["completion_tokens"] + r["usage"]["prompt_tokens"] == 256  # rest of context


def test_chat_logprobs_shape(client):
    c, _ = client
    r = c.post(CHAT, json=chat(seed=4, max_tokens=12, logprobs=True, top_logprobs=2)).json()
    ch = r["choices"][0]
    content = ch["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == ch["message"]["content"]
    for e in content:
        assert e["logprob"] == -(1 + ord(e["token"]) % 5) / 4  # the fake's logprob
        assert e["bytes"] == list(e["token"].encode())
        assert [(t["token"], t["logprob"]) for t in e["top_logprobs"]] == [("a", -0.5), ("b", -1.5)]
    events = sse_events(c, CHAT, chat(seed=4, max_tokens=12, logprobs=True, top_logprobs=2))
    assert merge_stream(events, "chat")[2][0] == content
    plain = c.post(CHAT, json=chat(seed=4, max_tokens=12)).json()["choices"][0]
    assert plain["logprobs"] is None


def test_completion_logprobs_shape(client):
    c, _ = client
    ch = c.post(COMP, json=comp(seed=4, max_tokens=12, logprobs=1)).json()["choices"][0]
    lp = ch["logprobs"]
    assert "".join(lp["tokens"]) == ch["text"]
    assert lp["token_logprobs"] == [-(1 + ord(t) % 5) / 4 for t in lp["tokens"]]
    assert lp["top_logprobs"] == [{"a": -0.5}] * len(lp["tokens"])
    assert lp["text_offset"] == list(range(len(lp["tokens"])))
    events = sse_events(c, COMP, comp(seed=4, max_tokens=12, logprobs=1))
    assert merge_stream(events, "completion")[2][0] == lp["token_logprobs"]


def test_dspark_stats(client):
    c, _ = client
    r = c.post(COMP, json=comp(seed=2, n=2, max_tokens=30, ignore_eos=True)).json()
    d = r["dspark"]
    assert set(d) == {"accepted_length", "verify_rounds", "drafted_tokens", "accepted_tokens"}
    # the fake emits 1, 2, 3, 1, 2, 3, ... tokens per round, 4 drafts per round
    rounds_per_choice = 30 // 6 * 3  # 30 tokens = 5 x (1 + 2 + 3)
    assert d["verify_rounds"] == 2 * rounds_per_choice
    assert d["drafted_tokens"] == 4 * d["verify_rounds"]
    assert d["accepted_tokens"] == 2 * (30 - rounds_per_choice)
    assert d["accepted_length"] == pytest.approx(60 / d["verify_rounds"])


def test_models_and_health(client):
    c, _ = client
    models = c.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [
        ("fake-model", "model", 256)]
    assert c.get("/v1/models/fake-model").json()["id"] == "fake-model"
    assert c.get("/health").json() == {"status": "ok"}
    # "default" names the served model; no model at all too
    assert c.post(CHAT, json={**chat(max_tokens=2), "model": "default"}).status_code == 200
    body = chat(max_tokens=2)
    del body["model"]
    assert c.post(CHAT, json=body).status_code == 200


def test_minus_infinity_logprobs_stay_json_numbers(make_fake_engine):
    tok = make_fake_engine().tokenizer
    for kind in ("chat", "completion"):
        b = ResponseBuilder(kind, "x", ["r"], [0], "m", TokenTexts(tok), logprobs=True)
        b.add(RequestOutput("r", [97], "a", new_logprobs=[float("-inf")],
                            new_top_logprobs=[{98: float("-inf")}], finished=True,
                            finish_reason="stop"))
        body = json.loads(b.response().model_dump_json())
        lp = body["choices"][0]["logprobs"]
        if kind == "chat":
            assert lp["content"][0]["logprob"] == -9999.0
            assert lp["content"][0]["top_logprobs"][0]["logprob"] == -9999.0
        else:
            assert lp["token_logprobs"] == [-9999.0] and lp["top_logprobs"] == [{"b": -9999.0}]
