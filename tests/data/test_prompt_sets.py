"""Prompt sets read out of registry wheels: real counts and texts, limits, the record-by-record
ShareGPT decoding of a truncated file, and the JSON cache."""
from __future__ import annotations

import gzip
import json

import pytest

from dspark_serve.data import prompt_sets
from dspark_serve.data.prompt_sets import (PROMPT_SETS, PromptRecord, load_prompts,
                                           load_records)


@pytest.mark.parametrize("name,count,first", [
    ("mtbench", 80, "Compose an engaging travel blog post about a recent trip to Hawaii, "
                    "highlighting cultural experiences and must-see attractions."),
    ("humaneval", 164, "Complete the following Python function.\n\n```python\nfrom typing "
                       "import List\n\n\ndef has_close_elements("),
    ("alpaca", 805, "What are the names of some famous actors that started their careers on "
                    "Broadway?"),
    ("sharegpt", 17393, "Summarize the main ideas of Jeff Walker's Product Launch Formula"),
    ("sharegpt-followups", 43898, "Summarize the main ideas of Brendon Burchard's Experts"),
])
def test_real_sets(name, count, first):
    prompts = load_prompts(name)
    assert len(prompts) == count
    assert prompts[0].startswith(first)
    assert all(isinstance(p, str) and p.strip() for p in prompts)


def test_references():
    assert load_records("mtbench", 1)[0].reference is None
    assert load_records("humaneval", 1)[0].reference.startswith(
        "    for idx, elem in enumerate(numbers):")
    assert load_records("sharegpt", 1)[0].reference.startswith(
        "Here are the main ideas of Jeff Walker's")
    followup = load_records("sharegpt-followups", 1)[0]
    assert followup.reference.startswith("Here are the main ideas of Brendon Burchard's")
    assert followup.opener == load_prompts("sharegpt", 1)[0]


def test_limit_is_prefix():
    assert load_prompts("humaneval", 5) == load_prompts("humaneval")[:5]
    assert len(load_prompts("mtbench", 1000)) == 80


@pytest.mark.parametrize("name,limit,exc", [
    ("gsm8k", None, ValueError), ("mtbench", 0, ValueError), ("mtbench", -3, ValueError),
    ("mtbench", 2.0, TypeError), ("mtbench", True, TypeError),
])
def test_bad_arguments(name, limit, exc):
    with pytest.raises(exc):
        load_prompts(name, limit)


def test_sharegpt_truncated_file():
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "first?"},
                                      {"from": "gpt", "value": "answer one"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "greeting"},
                                      {"from": "human", "value": "second?"},
                                      {"from": "gpt", "value": "answer two"},
                                      {"from": "human", "value": " "},
                                      {"from": "human", "value": "and then?"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "  "}]},
        {"id": "d", "conversations": [{"from": "human", "value": "cut off"}]},
    ]
    text = "[\n" + ",\n".join(json.dumps(r, indent=2) for r in records) + "\n]"
    truncated = text[:text.index('"cut off"') + 4]  # stops inside the last record
    parse = PROMPT_SETS["sharegpt"][3]
    assert list(parse(truncated.encode())) == [PromptRecord("first?", "answer one"),
                                               PromptRecord("second?", "answer two")]
    followups = PROMPT_SETS["sharegpt-followups"][3]
    assert list(followups(truncated.encode())) == [PromptRecord("and then?", None, "second?")]


def test_parse_once_then_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_SERVE_CACHE", str(tmp_path))
    tasks = [{"prompt": "def f():\n", "canonical_solution": "    return 1\n"}]
    raw = gzip.compress("\n".join(json.dumps(t) for t in tasks).encode())
    calls = []
    monkeypatch.setattr(prompt_sets, "wheel_member",
                        lambda *args: calls.append(args) or raw)
    expected = [PromptRecord(prompt_sets.HUMANEVAL_INSTRUCTION.format(prompt="def f():\n"),
                             "    return 1\n")]
    assert load_records("humaneval") == expected
    assert load_records("humaneval") == expected
    assert calls == [PROMPT_SETS["humaneval"][:3]]  # second load read the cache file
    assert (tmp_path / "prompt_sets" / "humaneval-v1.json").exists()


def test_followups_keep_their_opener_through_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_SERVE_CACHE", str(tmp_path))
    conversation = {"conversations": [{"from": "human", "value": "hi"},
                                      {"from": "gpt", "value": "hello"},
                                      {"from": "human", "value": "more"}]}
    monkeypatch.setattr(prompt_sets, "wheel_member",
                        lambda *args: json.dumps([conversation]).encode())
    expected = [PromptRecord("more", None, "hi")]
    assert load_records("sharegpt-followups") == expected
    assert load_records("sharegpt-followups") == expected    # read back from the cache file
    assert load_records("sharegpt") == [PromptRecord("hi", "hello")]
