"""SSE stream -> per-request record: TTFT, TPOT, tok/s/user, usage and dspark stats, errors."""
from __future__ import annotations

import json

import pytest

from dspark_serve.loadtest.records import StreamTracker


def _data(obj) -> str:
    return "data: " + json.dumps(obj)


def _chunk(content=None, finish=None, **extra):
    delta = {} if content is None else {"content": content}
    return _data({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})


STATS = {"accepted_length": 2.5, "verify_rounds": 4, "drafted_tokens": 16,
         "accepted_tokens": 6}


def test_full_stream():
    t = StreamTracker("mtbench", 64, t_start=100.0)
    lines = [(_chunk(""), 100.1),             # role chunk with empty content: not the first token
             ("", 100.1),
             (_chunk("Hello"), 100.5),
             (": keep-alive comment", 100.6),
             (_chunk(" world, again"), 101.0),
             (_chunk("", finish="stop", dspark=STATS), 101.2),
             (_data({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 11,
                                               "total_tokens": 23}, "dspark": STATS}), 101.3),
             ("data: [DONE]", 101.5)]
    for line, now in lines:
        t.feed(line.encode(), now)
    rec = t.record(101.5)
    assert rec.ok and rec.error == ""
    assert rec.ttft_s == pytest.approx(0.5)
    assert rec.e2e_s == pytest.approx(1.5)
    assert rec.tpot_s == pytest.approx(1.0 / 10)        # (101.5 - 100.5) / (11 - 1)
    assert rec.tok_s_user == pytest.approx(10.0)
    assert (rec.completion_tokens, rec.prompt_tokens, rec.finish_reason) == (11, 12, "stop")
    assert (rec.accepted_length, rec.verify_rounds, rec.drafted_tokens,
            rec.accepted_tokens) == (2.5, 4, 16, 6)


def test_without_usage_counts_content_chunks():
    t = StreamTracker("x", 8, t_start=0.0)
    for i, now in enumerate((1.0, 2.0, 3.0)):
        t.feed(_chunk(f"t{i}"), now)
    t.feed("data: [DONE]", 3.0)
    rec = t.record(3.0)
    assert rec.completion_tokens == 3 and rec.tpot_s == pytest.approx(1.0)
    assert rec.accepted_length is None


@pytest.mark.parametrize("lines,error", [
    ([_chunk("a")], "stream ended without [DONE]"),
    ([_chunk("a"), _data({"error": {"message": "boom", "type": "server_error"}}),
      "data: [DONE]"], "boom"),
    (["data: {not json", "data: [DONE]"], "malformed SSE payload: {not json"),
])
def test_failed_streams(lines, error):
    t = StreamTracker("x", 8, t_start=0.0)
    for line in lines:
        t.feed(line, 1.0)
    rec = t.record(2.0)
    assert not rec.ok and rec.error == error


def test_http_error_wins():
    t = StreamTracker("x", 8, t_start=0.0)
    rec = t.record(0.2, error="HTTP 400: bad")
    assert not rec.ok and rec.error == "HTTP 400: bad" and rec.ttft_s is None
