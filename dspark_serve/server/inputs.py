"""From an HTTP request body to engine inputs (prompt token ids and ``SamplingParams``), with
every bad input turned into an ``APIError`` carrying an OpenAI error object (400 / 404)."""
from __future__ import annotations

import dataclasses
import json
from typing import TypeVar

from jinja2 import TemplateError
from pydantic import BaseModel, ValidationError

from dspark_serve.engine.params import (MAX_TOP_LOGPROBS, SEED_MAX, SEED_MIN, InvalidParameter,
                                        SamplingParams)
from dspark_serve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                          SamplingRequest)
from dspark_serve.structured.spec import (GrammarError, GrammarSpec, json_schema_spec,
                                          regex_spec)

M = TypeVar("M", bound=BaseModel)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_SCALARS = {"str", "int", "float", "bool", "none"}


def parse_body(raw: bytes, model_cls: type[M]) -> M:
    """Decode and validate a JSON request body; malformed JSON or wrong types -> 400."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        # of a union's alternatives, report the one that got furthest into the value
        errors = [(_field_path(e["loc"]), e) for e in exc.errors(include_url=False)]
        raise _validation_error(*max(errors, key=lambda le: len(le[0]))) from None


def _field_path(loc: tuple) -> list:
    # union members appear in the location as type names ("str", "list[int]", "TextPart")
    return [p for p in loc if not (isinstance(p, str) and (
        p in _SCALARS or "[" in p or p[:1].isupper()))]


def _validation_error(loc: list, err: dict) -> APIError:
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    param = str(loc[0]) if loc else None
    if err["type"] == "extra_forbidden" and len(loc) == 1:
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if err["type"] == "missing":
        return APIError(400, f"Missing required parameter: '{path}'.", param=param)
    got = json.dumps(err.get("input"), default=str)[:100]
    return APIError(400, f"Invalid value for '{path}': {err['msg']} (got {got}).", param=param)


def chat_prompt(tokenizer, req: ChatCompletionRequest) -> list[int]:
    """Prompt token ids of a chat request, rendered with the tokenizer's chat template."""
    if not req.messages:
        raise APIError(400, "Invalid 'messages': empty array. Expected an array with minimum "
                            "length 1, but got an empty array instead.", param="messages")
    messages = []
    for m in req.messages:
        text = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        # OpenAI's "developer" role is the system role of chat templates
        message = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (TemplateError, ValueError, TypeError, KeyError) as exc:
        raise APIError(400, f"Invalid 'messages': the chat template rejected them: {exc}",
                       param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def completion_prompts(tokenizer, req: CompletionRequest, vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt of a completion request (a string, strings, ids or lists of ids)."""
    if req.echo:
        raise APIError(400, "'echo' is not supported.", param="echo")
    if req.suffix:
        raise APIError(400, "'suffix' is not supported.", param="suffix")
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        p = [p]
    if not p:
        raise APIError(400, "Invalid 'prompt': empty array.", param="prompt")
    prompts = []
    for item in p:
        ids = tokenizer.encode(item) if isinstance(item, str) else list(item)
        if any(not 0 <= t < vocab_size for t in ids):
            raise APIError(400, f"Invalid 'prompt': token ids must be in [0, {vocab_size}).",
                           param="prompt")
        if not ids:
            raise APIError(400, "Invalid 'prompt': the prompt is empty.", param="prompt")
        prompts.append(ids)
    return prompts


def grammar_spec(req: SamplingRequest) -> GrammarSpec | None:
    """The output constraint of ``response_format`` or ``regex`` (at most one), or None.

    Raises APIError 400 for both at once, a json_schema format without a schema, and a schema
    or regex that ``dspark_serve.structured.spec`` refuses (invalid or unsupported keyword).
    """
    fmt = req.response_format
    constrained = fmt is not None and fmt.type != "text"
    if constrained and req.regex is not None:
        raise APIError(400, "Only one of 'response_format' and 'regex' may constrain the output.",
                       param="regex")
    try:
        if req.regex is not None:
            return regex_spec(req.regex)
        if not constrained:
            return None
        if fmt.type == "json_object":
            return GrammarSpec("json_object")
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "Missing required parameter: "
                                "'response_format.json_schema.schema'.", param="response_format")
        return json_schema_spec(fmt.json_schema.schema_)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def sampling_params(req: SamplingRequest, prompt_len: int, max_model_len: int,
                    vocab_size: int) -> SamplingParams:
    """Engine parameters of one prompt, checked against the context and vocabulary.

    Raises APIError 400 (OpenAI wording, ``context_length_exceeded``) when the prompt plus the
    requested completion does not fit in ``max_model_len``.
    """
    is_chat = isinstance(req, ChatCompletionRequest)
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                            f"However, your prompt is {prompt_len} tokens long. Please reduce the "
                            f"length of the prompt.", param="messages" if is_chat else "prompt",
                       code="context_length_exceeded")
    max_tokens = (req.max_completion_tokens if is_chat and req.max_completion_tokens is not None
                  else req.max_tokens)
    if max_tokens is None:  # OpenAI defaults: the rest of the context (chat), 16 (completions)
        max_tokens = room if is_chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    elif max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                            f"However, you requested {prompt_len + max_tokens} tokens "
                            f"({prompt_len} in the prompt, {max_tokens} in the completion). Please "
                            f"reduce the length of the prompt or completion.", param="max_tokens",
                       code="context_length_exceeded")
    if is_chat:
        logprobs, top_logprobs = bool(req.logprobs), req.top_logprobs or 0
    else:
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"Invalid 'logprobs': expected a value in [0, {MAX_TOP_LOGPROBS}]"
                                f", but got {req.logprobs} instead.", param="logprobs")
        logprobs, top_logprobs = req.logprobs is not None, req.logprobs or 0
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "The 'stream_options' parameter is only allowed when 'stream' is "
                            "enabled.", param="stream_options")
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise APIError(400, f"Invalid key in 'logit_bias': {key!r}. Keys must be token ids.",
                           param="logit_bias") from None
    params = SamplingParams(
        n=1 if req.n is None else req.n, max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=bool(req.ignore_eos),
        seed=req.seed, frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=bias, logprobs=logprobs, top_logprobs=top_logprobs,
        structured=grammar_spec(req))
    try:
        params.validate(vocab_size)
    except InvalidParameter as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    return params


def expand_choices(params: SamplingParams) -> list[SamplingParams]:
    """One engine request per choice: n copies with n = 1 and seeds seed, seed+1, ... (wrapping
    in the int64 range) so seeded choices are independent yet reproducible."""
    out = []
    for i in range(params.n):
        seed = params.seed
        if seed is not None:
            seed = (seed + i - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN
        out.append(dataclasses.replace(params, n=1, seed=seed))
    return out
