"""What a request's output must match, and the checks that reject what cannot be served.

A ``GrammarSpec`` is plain data (it travels in ``SamplingParams``); compiling it needs the
target's tokenizer (``dspark_serve.structured.compiler``). The JSON-schema check accepts only
keywords the grammar backend enforces: a keyword it silently ignored (measured for xgrammar
0.2: ``allOf``, ``oneOf`` (treated as anyOf), ``not``, ``uniqueItems``, ``contains``,
``propertyNames``, ``dependentRequired``, ``if``/``then``/``else``) would let the engine return
JSON that does not validate, so such a schema is refused with a 400 naming the keyword.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

MAX_SCHEMA_CHARS = 64 * 1024   # compile time grows with the schema; bound it per request
MAX_REGEX_CHARS = 4 * 1024
MAX_SCHEMA_DEPTH = 32

GrammarKind = Literal["json_object", "json_schema", "regex"]

# Keywords that only annotate (no effect on validity).
_ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "title", "description", "default",
                          "examples", "deprecated", "readOnly", "writeOnly", "format",
                          "$defs", "definitions"})
# Keywords the backend enforces (each checked by generating from it and validating).
_ENFORCED = frozenset({"type", "enum", "const", "anyOf", "$ref", "properties", "required",
                       "additionalProperties", "patternProperties", "items", "prefixItems",
                       "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum",
                       "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# Keywords whose value is a schema / a map of schemas / a list of schemas.
_SUBSCHEMA = ("additionalProperties", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "prefixItems")


class GrammarError(ValueError):
    """A response format or regex that cannot be served; ``param`` names the request field
    (OpenAI error ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One request's output constraint.

    kind: "json_object" (any JSON object), "json_schema" (``source`` is the schema as JSON
        text) or "regex" (``source`` is the pattern the whole output must match).
    param: request field it came from, for error messages ("response_format" or "regex").
    """

    kind: GrammarKind
    source: str = ""
    param: str = "response_format"

    @property
    def format(self) -> str:
        """Metrics label: "json" or "regex"."""
        return "regex" if self.kind == "regex" else "json"


def json_schema_spec(schema: object) -> GrammarSpec:
    """Spec of ``response_format: {"type": "json_schema", "json_schema": {"schema": ...}}``.

    Raises:
        GrammarError: not a JSON object or boolean, too large or deep, invalid under the JSON
            Schema meta-schema, a non-local ``$ref``, or an unsupported keyword.
    """
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("response_format", "Invalid 'response_format.json_schema.schema': "
                           f"expected a JSON object, got {type(schema).__name__}.")
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError("response_format", f"Invalid 'response_format.json_schema.schema': "
                           f"{len(text)} characters; at most {MAX_SCHEMA_CHARS} are supported.")
    _check_meta_schema(schema)
    _check_keywords(schema, "#", 0)
    return GrammarSpec("json_schema", text)


def regex_spec(pattern: object) -> GrammarSpec:
    """Spec of the ``regex`` extension parameter (the whole output must match).

    Raises:
        GrammarError: not a non-empty string or too long (syntax is checked when compiled).
    """
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError("regex", "Invalid 'regex': expected a non-empty string.")
    if len(pattern) > MAX_REGEX_CHARS:
        raise GrammarError("regex", f"Invalid 'regex': {len(pattern)} characters; at most "
                                    f"{MAX_REGEX_CHARS} are supported.")
    return GrammarSpec("regex", pattern, param="regex")


def _check_meta_schema(schema: dict | bool) -> None:
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise GrammarError("response_format", f"Invalid 'response_format.json_schema.schema' at "
                           f"{where}: {exc.message}") from None


def _check_keywords(schema: object, path: str, depth: int) -> None:
    """Refuse keywords outside _ANNOTATIONS | _ENFORCED anywhere in the schema."""
    if isinstance(schema, bool):
        return
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError("response_format", f"Invalid 'response_format.json_schema.schema': "
                           f"nested deeper than {MAX_SCHEMA_DEPTH} levels.")
    for key, value in schema.items():
        if key not in _ANNOTATIONS and key not in _ENFORCED:
            raise GrammarError("response_format", f"Unsupported JSON schema keyword '{key}' at "
                               f"{path}: structured outputs support "
                               f"{', '.join(sorted(_ENFORCED))} (plus annotations).")
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise GrammarError("response_format", f"Unsupported '$ref' {value!r} at {path}: only "
                               "local references ('#/...') are supported.")
        if key == "type":
            bad = set([value] if isinstance(value, str) else value) - _TYPES
            if bad:
                raise GrammarError("response_format", f"Invalid type {sorted(bad)} at {path}.")
        if key in _SUBSCHEMA and isinstance(value, (dict, bool)):
            _check_keywords(value, f"{path}/{key}", depth + 1)
        elif key in _SCHEMA_MAPS:
            for name, sub in value.items():
                _check_keywords(sub, f"{path}/{key}/{name}", depth + 1)
        elif key in _SCHEMA_LISTS:
            for i, sub in enumerate(value):
                _check_keywords(sub, f"{path}/{key}/{i}", depth + 1)
