"""The official ``openai`` client against the real uvicorn server on a loopback port."""
import openai
import pytest


@pytest.fixture(scope="module")
def client(fake_server):
    url, _, _ = fake_server
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20) as c:
        yield c


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model="fake-model", messages=MESSAGES, seed=42,
                                          max_tokens=40)
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens >= 1
    assert full.model_extra["dspark"]["verify_rounds"] >= 1
    stream = client.chat.completions.create(model="fake-model", messages=MESSAGES, seed=42,
                                            max_tokens=40, stream=True,
                                            stream_options={"include_usage": True})
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            reasons.append(ch.finish_reason)
        usage = chunk.usage or usage
    assert "".join(pieces) == text
    assert [r for r in reasons if r] == [full.choices[0].finish_reason]
    assert usage == full.usage


def test_completions_with_logprobs_and_n(client):
    r = client.completions.create(model="fake-model", prompt="abc", max_tokens=8, n=2, seed=3,
                                  logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.text) == 8 and "".join(c.logprobs.tokens) == c.text
        assert len(c.logprobs.top_logprobs) == 8
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 16


def test_errors_map_to_client_exceptions(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-5", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake-model", messages=MESSAGES, temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="empty array"):
        client.chat.completions.create(model="fake-model", messages=[])
    assert [m.id for m in client.models.list()] == ["fake-model"]
