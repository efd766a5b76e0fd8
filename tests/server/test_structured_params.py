"""``response_format`` and ``regex`` reach the engine as ``SamplingParams.structured`` (every
choice of an n > 1 request), compiled once before the requests are added; the fake engine
does not enforce them (tests/reliability/test_structured.py runs the real one)."""
from __future__ import annotations

import json

import httpx
import pytest

from dspark_serve.structured.spec import GrammarSpec

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("path, fields, spec", [
    (CHAT, {"response_format": {"type": "json_object"}}, GrammarSpec("json_object")),
    (COMP, {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     GrammarSpec("json_schema", json.dumps(SCHEMA))),
    (COMP, {"regex": "[0-9]+"}, GrammarSpec("regex", "[0-9]+", param="regex")),
    (CHAT, {"response_format": {"type": "text"}}, None),
    (CHAT, {}, None),
])
def test_constraint_reaches_every_choice(fake_server, path, fields, spec):
    url, engine, _ = fake_server
    body = {"n": 2, "max_tokens": 3, **fields,
            **({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT
               else {"prompt": "hi"})}
    added, compiled = len(engine.added), len(engine.compiled)
    r = httpx.post(url + path, json=body, timeout=10)
    assert r.status_code == 200, r.text
    new = engine.added[added:]
    assert len(new) == 2
    assert [engine.added_params[rid].structured for rid in new] == [spec, spec]
    assert engine.compiled[compiled:] == ([spec] if spec is not None else [])
