"""Every bad request gets an OpenAI error object with a 4xx status, never reaches the engine,
and the server keeps serving."""
import json

import httpx
import pytest

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hello"}]


def chat(**kw):
    return {"model": "fake-model", "messages": MSG, **kw}


def comp(**kw):
    return {"model": "fake-model", "prompt": "hello", **kw}


CASES = [
    # (id, path, body (dict or raw str), status, param, message fragment)
    ("malformed-json", CHAT, '{"messages": [', 400, None, "could not parse the JSON body"),
    ("not-utf8", CHAT, b"\xff\xfe{", 400, None, "could not parse the JSON body"),
    ("not-an-object", CHAT, "[1, 2]", 400, None, "must be a JSON object"),
    ("missing-messages", CHAT, {"model": "fake-model"}, 400, "messages",
     "Missing required parameter: 'messages'"),
    ("messages-wrong-type", CHAT, chat(messages="hello"), 400, "messages", "valid list"),
    ("bad-role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages",
     "messages[0].role"),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages", "'text'"),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature", "valid number"),
    ("max-tokens-string", CHAT, chat(max_tokens="5"), 400, "max_tokens", "valid integer"),
    ("max-tokens-float", COMP, comp(max_tokens=5.0), 400, "max_tokens", "valid integer"),
    ("n-bool", CHAT, chat(n=True), 400, "n", "valid integer"),
    ("stream-string", CHAT, chat(stream="yes"), 400, "stream", "valid boolean"),
    ("stop-wrong-type", CHAT, chat(stop=["a", 3]), 400, "stop", "valid string"),
    ("unknown-argument", CHAT, chat(tools=[]), 400, "tools",
     "Unrecognized request argument supplied: tools"),
    ("unknown-model", CHAT, chat(model="gpt-5"), 404, "model", "The model `gpt-5` does not exist"),
    ("unknown-model-completions", COMP, comp(model="nope"), 404, "model", "does not exist"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages", "empty array"),
    ("template-rejects", CHAT, chat(messages=MSG + [{"role": "system", "content": "late"}]), 400,
     "messages", "System message must be first"),
    ("prompt-too-long-chat", CHAT, chat(messages=[{"role": "user", "content": "x" * 300}]), 400,
     "messages", "maximum context length is 256 tokens"),
    ("prompt-too-long-completions", COMP, comp(prompt="x" * 256), 400, "prompt",
     "maximum context length is 256 tokens"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens", "Expected a value >= 1"),
    ("max-tokens-negative", COMP, comp(max_tokens=-5), 400, "max_tokens", "below minimum"),
    ("max-tokens-huge", CHAT, chat(max_tokens=10 ** 9), 400, "max_tokens",
     "However, you requested"),
    ("max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), 400, "max_tokens",
     "Expected a value >= 1"),
    ("temperature-negative", CHAT, chat(temperature=-0.5), 400, "temperature", ">= 0"),
    ("temperature-too-high", COMP, comp(temperature=3), 400, "temperature", "<= 2"),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p", "> 0"),
    ("logit-bias-key-text", CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias",
     "Invalid key in 'logit_bias': 'abc'"),
    ("logit-bias-key-negative", CHAT, chat(logit_bias={"-1": 1}), 400, "logit_bias",
     "Invalid key in 'logit_bias': -1"),
    ("logit-bias-key-past-vocab", COMP, comp(logit_bias={"128": 1}), 400, "logit_bias",
     "Invalid key in 'logit_bias': 128"),
    ("logit-bias-value", CHAT, chat(logit_bias={"5": 500}), 400, "logit_bias", "<= 100"),
    ("n-too-large", CHAT, chat(n=17), 400, "n", "Expected a value <= 16"),
    ("n-zero", COMP, comp(n=0), 400, "n", ">= 1"),
    ("penalty-range", CHAT, chat(frequency_penalty=2.5), 400, "frequency_penalty", "<= 2"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs",
     "requires 'logprobs'"),
    ("top-logprobs-too-many", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "<= 20"),
    ("completion-logprobs-too-many", COMP, comp(logprobs=21), 400, "logprobs", "[0, 20]"),
    ("stop-token-id-past-vocab", CHAT, chat(stop_token_ids=[128]), 400, "stop_token_ids",
     "not a token id"),
    ("empty-stop-string", CHAT, chat(stop=[""]), 400, "stop", "non-empty"),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400,
     "stream_options", "only allowed when 'stream' is enabled"),
    ("empty-prompt", COMP, comp(prompt=""), 400, "prompt", "the prompt is empty"),
    ("empty-prompt-list", COMP, comp(prompt=[]), 400, "prompt", "empty array"),
    ("prompt-token-past-vocab", COMP, comp(prompt=[1, 2, 999]), 400, "prompt", "[0, 128)"),
    ("prompt-wrong-type", COMP, comp(prompt=5), 400, "prompt", "valid"),
    ("echo-unsupported", COMP, comp(echo=True), 400, "echo", "not supported"),
    ("suffix-unsupported", COMP, comp(suffix="end"), 400, "suffix", "not supported"),
    ("response-format-type", CHAT, chat(response_format={"type": "xml"}), 400,
     "response_format", "response_format.type"),
    ("response-format-no-schema", COMP, comp(response_format={
        "type": "json_schema", "json_schema": {"name": "x"}}), 400, "response_format",
     "Missing required parameter: 'response_format.json_schema.schema'"),
    ("response-format-unsupported-keyword", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}), 400,
     "response_format", "Unsupported JSON schema keyword 'not' at #"),
    ("response-format-invalid-schema", COMP, comp(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}), 400,
     "response_format", "Invalid 'response_format.json_schema.schema' at type"),
    ("regex-and-response-format", CHAT, chat(regex="a+", response_format={
        "type": "json_object"}), 400, "regex", "Only one of 'response_format' and 'regex'"),
    ("regex-empty", COMP, comp(regex=""), 400, "regex", "non-empty string"),
    ("regex-wrong-type", COMP, comp(regex=["a"]), 400, "regex", "valid string"),
]


@pytest.fixture(scope="module")
def client(fake_server):
    url, engine, _ = fake_server
    with httpx.Client(base_url=url, timeout=10) as c:
        yield c, engine


@pytest.mark.parametrize("name, path, body, status, param, text", CASES, ids=[c[0] for c in CASES])
def test_bad_request(client, name, path, body, status, param, text):
    c, engine = client
    added = len(engine.added)
    raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
    r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert text in err["message"], err["message"]
    assert len(engine.added) == added  # rejected before reaching the engine
    # the server keeps serving
    ok = c.post(CHAT, json=chat(max_tokens=3, temperature=0))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_context_error_code(client):
    c, _ = client
    r = c.post(CHAT, json=chat(max_tokens=10 ** 6))
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = c.post(CHAT, json=chat(model="nope"))
    assert r.json()["error"]["code"] == "model_not_found"


def test_max_tokens_exactly_filling_context_is_accepted(client):
    c, _ = client
    prompt = "y" * 200
    r = c.post(COMP, json=comp(prompt=prompt, max_tokens=256 - 200, ignore_eos=True, temperature=0))
    assert r.status_code == 200
    assert r.json()["usage"] == {"prompt_tokens": 200, "completion_tokens": 56, "total_tokens": 256}
    r = c.post(COMP, json=comp(prompt=prompt, max_tokens=256 - 199))
    assert r.status_code == 400


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nothing", 404), ("GET", CHAT, 405), ("GET", "/v1/models/gpt-5", 404)])
def test_routing_errors_are_error_objects(client, method, path, status):
    c, _ = client
    r = c.request(method, path)
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
