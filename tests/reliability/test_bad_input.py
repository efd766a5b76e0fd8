"""Bad requests against the real servers: each gets a 4xx OpenAI error object, never a 5xx, and
the server keeps serving (the same greedy answer as before, health ok). The long list of bad
inputs runs against a fake engine in tests/server; this is the subset where the real engine,
tokenizer and context limit are involved."""
from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD = {"prompt": "The capital of Italy is", "temperature": 0, "max_tokens": 6}
HELLO = [{"role": "user", "content": "hello"}]
BAD = [
    ("malformed_json", COMPLETIONS, b'{"prompt": "hi", "max_tokens": 4', 400),
    ("not_an_object", COMPLETIONS, b'["prompt"]', 400),
    ("wrong_type_max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": "4"}, 400),
    ("wrong_type_messages", CHAT, {"messages": "hello"}, 400),
    ("negative_max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400),
    ("zero_max_tokens", CHAT, {"messages": HELLO, "max_tokens": 0}, 400),
    ("huge_max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": 10 ** 12}, 400),
    ("negative_temperature", CHAT, {"messages": HELLO, "temperature": -0.5}, 400),
    ("unknown_model", CHAT, {"model": "gpt-17", "messages": HELLO}, 404),
    ("empty_messages", CHAT, {"messages": []}, 400),
    ("prompt_longer_than_context", COMPLETIONS, {"prompt": "word " * 600, "max_tokens": 1}, 400),
    ("prompt_ids_outside_vocab", COMPLETIONS, {"prompt": [1, 2, 10 ** 9]}, 400),
    ("logit_bias_key_not_int", COMPLETIONS, {"prompt": "hi", "logit_bias": {"abc": 1.0}}, 400),
    ("logit_bias_key_outside_vocab", COMPLETIONS, {"prompt": "hi", "logit_bias": {"999999": 1}},
     400),
    ("logit_bias_value_too_big", COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 1000}}, 400),
    ("n_too_large", COMPLETIONS, {"prompt": "hi", "n": 1000}, 400),
]


@pytest.fixture(scope="module")
def good_answers(ref_server, spec_server):
    return {s.name: s.complete(GOOD)["choices"][0]["text"] for s in (ref_server, spec_server)}


@pytest.mark.parametrize("path,body,status", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_gets_openai_error(server, good_answers, path, body, status):
    r = server.post(path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_server_keeps_serving_after_bad_requests(server, good_answers):
    assert server.complete(GOOD)["choices"][0]["text"] == good_answers[server.name]
    server.wait_idle()
    assert server.engine.kv_free_tokens() == server.initial_kv
