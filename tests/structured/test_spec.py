"""Request-level checks of structured-output specs: what is refused, with which message, and
that every keyword the check lets through is really enforced by the compiled grammar."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from dspark_serve.structured.masking import bitmask_to_bool, new_bitmask
from dspark_serve.structured.spec import (MAX_REGEX_CHARS, MAX_SCHEMA_CHARS, GrammarError,
                                          GrammarSpec, json_schema_spec, regex_spec)

V = 49152
EOS = 2


@pytest.mark.parametrize("schema, message", [
    ([1, 2], "expected a JSON object"),
    ({"type": "object", "allOf": [{"type": "object"}]},
     "Unsupported JSON schema keyword 'allOf' at #"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
    ({"properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
     "'oneOf' at #/properties/a"),
    ({"not": {"type": "string"}}, "'not'"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "'if'"),
    ({"$ref": "http://example.com/schema.json"}, "only local references"),
    ({"type": "strng"}, "is not valid under any of the given schemas"),
    ({"type": "object", "required": "name"}, "at required"),
])
def test_refused_schemas_name_the_problem(schema, message):
    with pytest.raises(GrammarError, match=message) as err:
        json_schema_spec(schema)
    assert err.value.param == "response_format"


def test_size_and_depth_limits():
    big = {"type": "object", "description": "x" * MAX_SCHEMA_CHARS}
    with pytest.raises(GrammarError, match="at most"):
        json_schema_spec(big)
    deep: dict = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarError, match="nested deeper"):
        json_schema_spec(deep)
    with pytest.raises(GrammarError, match="at most"):
        regex_spec("a" * (MAX_REGEX_CHARS + 1))
    with pytest.raises(GrammarError, match="non-empty string") as err:
        regex_spec("")
    assert err.value.param == "regex"


def test_spec_fields():
    spec = json_schema_spec({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert (spec.kind, json.loads(spec.source), spec.format) == (
        "json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}, "json")
    assert regex_spec("[0-9]+") == GrammarSpec("regex", "[0-9]+", param="regex")
    assert regex_spec("a").format == "regex"


@pytest.mark.slow
@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("regex", "(ab", param="regex"), "Invalid 'regex': Regex parsing error"),
    (GrammarSpec("regex", "(?=a)b", param="regex"), "Lookahead is not supported"),
    (GrammarSpec("json_schema", '{"type": "string", "minLength": 5, "maxLength": 3}'),
     "Invalid 'response_format.json_schema.schema': minLength 5 is greater than maxLength 3"),
])
def test_compile_errors_are_grammar_errors(compiler, spec, message):
    with pytest.raises(GrammarError, match=message) as err:
        compiler.compile(spec)
    assert err.value.param == spec.param
    assert "/project/" not in str(err.value)  # the backend's source location is dropped


# Every enforced keyword with a schema that a grammar ignoring it would violate often.
ENFORCED = {
    "minimum/maximum": {"type": "number", "minimum": 1.5, "maximum": 3},
    "exclusive bounds": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 4},
    "pattern": {"type": "string", "pattern": "^[a-c]{2}x$"},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                          "maxItems": 3},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                    "items": False},
    "enum/const": {"type": "array", "items": {"anyOf": [{"enum": ["x", 1, None]},
                                                        {"const": {"a": [1, 2]}}]}},
    "additionalProperties": {"type": "object", "properties": {"a": {"type": "integer"}},
                             "additionalProperties": {"type": "boolean"}},
    "patternProperties": {"type": "object", "patternProperties": {"^a": {"type": "integer"}},
                          "additionalProperties": False},
    "multipleOf": {"type": "integer", "multipleOf": 7},
    "$ref/required": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}},
                                      "required": ["x"]}},
                      "type": "array", "items": {"$ref": "#/$defs/p"}},
}
_SHORT = {'"', "}", "]", ",", ":", "0", "1", "2", "7", "9", "-", ".", "e", "true", "false",
          "null", "{", "[", "a", "b", "c", "x"}


@pytest.fixture(scope="module")
def short_tokens(tokenizer) -> torch.Tensor:
    """[V] bool: tokens whose text is one of _SHORT (the walks prefer them)."""
    texts = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    short = torch.zeros(V, dtype=torch.bool)
    for t, text in enumerate(texts):
        short[t] = tokenizer.convert_tokens_to_string([text]).strip() in _SHORT
    return short


def _random_output(compiler, tokenizer, short_tokens, spec: GrammarSpec, rng: random.Random,
                   cap: int = 200):
    """A random token walk through the grammar (punctuation-heavy so it ends), or None."""
    state, mask, out = compiler.new_state(spec), new_bitmask(1, V), []
    for _ in range(cap):
        state.fill(mask, 0)
        allowed = bitmask_to_bool(mask[0], V)
        if allowed[EOS] and (int(allowed.sum()) == 1 or rng.random() < 0.7):
            return tokenizer.decode(out)
        allowed[EOS] = False
        short = (allowed & short_tokens).nonzero().flatten().tolist()
        allowed = allowed.nonzero().flatten().tolist()
        token = rng.choice(short) if short and rng.random() < 0.85 else rng.choice(allowed)
        assert state.accept(token)
        out.append(token)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ENFORCED))
def test_enforced_keywords_are_enforced(compiler, tokenizer, short_tokens, name):
    """Outputs of random walks through each grammar validate against the schema (the walks
    found violations for every keyword the spec check refuses, e.g. 25 of 40 for
    uniqueItems)."""
    schema = ENFORCED[name]
    spec = json_schema_spec(schema)
    rng = random.Random(0)
    outputs = [o for o in (_random_output(compiler, tokenizer, short_tokens, spec, rng)
                                  for _ in range(30))
               if o is not None]
    assert len(outputs) >= 20
    for text in outputs:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
def test_json_object_is_any_compact_object(compiler, encode):
    spec = GrammarSpec("json_object")
    for text, ok in [('{"a": [1, {"b": null}], "c": "d"}', True), ("{}", True),
                     ("[1]", False), ('{"a":1}', False), ('"x"', False)]:
        state = compiler.new_state(spec)
        assert all(state.accept(t) for t in encode(text)) == ok, text
