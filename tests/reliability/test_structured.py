"""Structured outputs over HTTP on the real servers (``response_format`` json_object /
json_schema and the ``regex`` extension, both endpoints): every finished output parses and
validates, greedy outputs with speculation equal plain decoding's, bad or unsupported schemas
get a 400 naming the problem while the server keeps serving, and /metrics splits acceptance
by output format."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_TOKENS = 40
PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
ITEMS = {"type": "object", "required": ["items"],
         "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"enum": ["apple", "bread", "milk", "tea"]}}}}
REGEX = r"(yes|no)\. [A-Z][a-z]{2,10}( [a-z]{2,10}){0,3}\."


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


# (name, endpoint, body fields, schema to validate against; None = the regex)
CASES = [
    ("chat-person", CHAT, {"messages": [{"role": "user", "content": "Invent a person (JSON)."}],
                           "response_format": schema_format(PERSON)}, PERSON),
    ("chat-object", CHAT, {"messages": [{"role": "user", "content": "Describe a dog in JSON."}],
                           "response_format": {"type": "json_object"}}, {"type": "object"}),
    ("chat-regex", CHAT, {"messages": [{"role": "user", "content": "Is ice cold? Answer."}],
                          "regex": REGEX}, None),
    ("completion-items", COMPLETIONS, {"prompt": "A shopping list as JSON:",
                                       "response_format": schema_format(ITEMS)}, ITEMS),
    ("completion-regex", COMPLETIONS, {"prompt": "Question: is fire hot? Answer:",
                                       "regex": REGEX}, None),
]


def text_of(body: dict, path: str) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if path == CHAT else choice["text"]


def check(body: dict, path: str, schema: dict | None) -> None:
    choice, text = body["choices"][0], text_of(body, path)
    if choice["finish_reason"] == "length":
        assert body["usage"]["completion_tokens"] == MAX_TOKENS, text
        return
    assert choice["finish_reason"] == "stop", choice
    if schema is None:
        assert re.fullmatch(REGEX, text), text
    else:
        jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def greedy_plain(ref_server) -> dict[str, dict]:
    """The plain server's greedy answers (these also teach the spec server's oracle)."""
    return {name: ref_server.complete({**body, "temperature": 0, "max_tokens": MAX_TOKENS},
                                      path) for name, path, body, _ in CASES}


def test_greedy_outputs_validate_and_speculation_changes_nothing(ref_server, spec_server,
                                                                 greedy_plain, oracle_mode):
    for name, path, _, schema in CASES:
        check(greedy_plain[name], path, schema)
    stopped = sum(b["choices"][0]["finish_reason"] == "stop" for b in greedy_plain.values())
    assert stopped >= 4
    with oracle_mode("mixed"):  # partial acceptance and rejections, deterministic
        bodies = [({**body, "temperature": 0, "max_tokens": MAX_TOKENS}, path)
                  for _, path, body, _ in CASES]
        spec = [spec_server.complete(b, p) for b, p in bodies]
    for (name, path, _, _), body in zip(CASES, spec):
        assert text_of(body, path) == text_of(greedy_plain[name], path), name
        assert body["choices"][0]["finish_reason"] == \
            greedy_plain[name]["choices"][0]["finish_reason"]
    assert sum(b["dspark"]["accepted_tokens"] for b in spec) > len(CASES)  # blocks accepted


def test_sampled_outputs_validate_at_concurrency(server):
    """Temperature 1 (unseeded) and greedy requests of every case, 6 clients at a time."""
    bodies, kinds = [], []
    for name, path, body, schema in CASES:
        for temperature in (0.0, 1.0):
            bodies.append(({**body, "temperature": temperature, "max_tokens": MAX_TOKENS}, path))
            kinds.append((path, schema))
    for path in (CHAT, COMPLETIONS):
        sel = [i for i, (_, p) in enumerate(bodies) if p == path]
        answers = server.complete_many([bodies[i][0] for i in sel], concurrency=6, path=path)
        for i, body in zip(sel, answers):
            check(body, *kinds[i])


def test_streamed_equals_non_streamed(server, greedy_plain):
    name, path, body, schema = CASES[0]
    text, chunks = server.stream({**body, "temperature": 0, "max_tokens": MAX_TOKENS}, path)
    assert text == text_of(greedy_plain[name], path)
    assert chunks[-1]["choices"][0]["finish_reason"] == \
        greedy_plain[name]["choices"][0]["finish_reason"]


HELLO = [{"role": "user", "content": "hello"}]
BAD_FORMATS = [
    ("schema_missing", {"type": "json_schema", "json_schema": {"name": "x"}},
     "Missing required parameter: 'response_format.json_schema.schema'"),
    ("unknown_type", {"type": "xml"}, "Invalid value for 'response_format.type'"),
    ("invalid_schema", schema_format({"type": "object", "required": "name"}), "at required"),
    ("unsupported_keyword", schema_format({"type": "array", "uniqueItems": True}),
     "Unsupported JSON schema keyword 'uniqueItems'"),
    ("remote_ref", schema_format({"$ref": "https://example.com/s.json"}),
     "only local references"),
    ("uncompilable_schema", schema_format({"type": "string", "minLength": 5, "maxLength": 2}),
     "minLength 5 is greater than maxLength 2"),
]
BAD_REGEXES = [("unclosed", "(ab", "Invalid 'regex': Regex parsing error"),
               ("lookahead", "(?=a)b", "Lookahead is not supported"),
               ("not_a_string", 5, "Invalid value for 'regex'")]


@pytest.mark.parametrize("fmt,message", [b[1:] for b in BAD_FORMATS],
                         ids=[b[0] for b in BAD_FORMATS])
def test_bad_response_format_is_a_400(server, fmt, message):
    for path, body in ((CHAT, {"messages": HELLO}), (COMPLETIONS, {"prompt": "hi"})):
        r = server.post(path, {**body, "response_format": fmt, "max_tokens": 4})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == "response_format", error
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("regex,message", [b[1:] for b in BAD_REGEXES],
                         ids=[b[0] for b in BAD_REGEXES])
def test_bad_regex_is_a_400(server, regex, message):
    r = server.post(COMPLETIONS, {"prompt": "hi", "regex": regex, "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and r.json()["error"]["param"] == "regex"


def test_two_constraints_are_a_400_and_the_server_keeps_serving(server, greedy_plain):
    r = server.post(CHAT, {"messages": HELLO, "regex": "a+",
                           "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex", r.text
    name, path, body, _ = CASES[0]
    again = server.complete({**body, "temperature": 0, "max_tokens": MAX_TOKENS}, path)
    assert text_of(again, path) == text_of(greedy_plain[name], path)
    server.wait_idle()
    assert server.engine.kv_free_tokens() == server.initial_kv


def test_metrics_split_acceptance_by_format(spec_server, greedy_plain, oracle_mode):
    with oracle_mode("greedy"):
        for name, path, body, _ in CASES[:2]:
            spec_server.complete({**body, "temperature": 0, "max_tokens": MAX_TOKENS}, path)
        spec_server.complete({"prompt": "Once upon a time", "temperature": 0, "max_tokens": 8})
    text = httpx.get(spec_server.url + "/metrics").text

    def value(metric: str) -> float:
        match = re.search(rf"^{re.escape(metric)} ([0-9.e+-]+)$", text, re.M)
        assert match, metric
        return float(match.group(1))

    rounds = value('dspark_format_verify_rounds_total{format="json"}')
    accepted = value('dspark_format_accepted_tokens_total{format="json"}')
    assert rounds > 0 and accepted > 0
    assert value('dspark_format_verify_rounds_total{format="text"}') > 0
    assert value("dspark_grammar_mask_seconds_count") > 0
