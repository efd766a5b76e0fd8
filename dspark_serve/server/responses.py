"""From engine ``RequestOutput`` deltas to OpenAI bodies: the non-streamed response and the
streamed chunks of /v1/completions and /v1/chat/completions, in OpenAI's logprobs shapes."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from dspark_serve.engine.outputs import RequestOutput, SpecStats
from dspark_serve.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                          ChatCompletionResponse, ChatLogprobs, ChatResponseMessage,
                                          ChatTokenLogprob, CompletionChoice, CompletionLogprobs,
                                          CompletionResponse, DeltaMessage, DSparkStats,
                                          TopLogprob, UsageInfo)


MIN_LOGPROB = -9999.0  # stands in for -inf (tokens the warping removed), which JSON cannot carry


def _finite(lp: float) -> float:
    return max(float(lp), MIN_LOGPROB)


class TokenTexts:
    """Text of single tokens (the ``token`` strings of logprobs), decoded once and cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text_len: int = 0  # characters of token strings so far (completion text_offset)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)


class ResponseBuilder:
    """Accumulates the outputs of one HTTP request's engine requests (one per choice).

    Args:
        kind: "chat" or "completion".
        response_id: the body's ``id``.
        request_ids: engine request id of each choice, in choice order.
        prompt_of_choice: which prompt each choice belongs to (usage counts a prompt once).
        model: model name echoed in the bodies.
        token_texts: shared ``TokenTexts`` for logprobs.
        logprobs: whether the request asked for logprobs.
    """

    def __init__(self, kind: str, response_id: str, request_ids: list[str],
                 prompt_of_choice: list[int], model: str, token_texts: TokenTexts, logprobs: bool):
        self.kind = kind
        self.id = response_id
        self.want_logprobs = logprobs
        self.created = int(time.time())
        self.model = model
        self.token_texts = token_texts
        self.choices = {rid: _Choice(i) for i, rid in enumerate(request_ids)}
        self.prompt_of_choice = prompt_of_choice

    def add(self, out: RequestOutput) -> _Choice:
        """Record one delta; returns the choice it belongs to."""
        c = self.choices[out.request_id]
        c.text.append(out.new_text)
        c.token_ids += out.new_token_ids
        if out.new_logprobs is not None:
            c.logprobs += out.new_logprobs
            c.top_logprobs += out.new_top_logprobs or [{} for _ in out.new_logprobs]
        c.finish_reason = out.finish_reason if out.finished else None
        c.prompt_tokens, c.completion_tokens, c.stats = (out.prompt_tokens, out.completion_tokens,
                                                         out.stats)
        return c

    def usage(self) -> UsageInfo:
        prompts = {}
        for c in self.choices.values():
            prompts[self.prompt_of_choice[c.index]] = c.prompt_tokens
        prompt = sum(prompts.values())
        completion = sum(c.completion_tokens for c in self.choices.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion)

    def dspark(self, choices: list[_Choice] | None = None) -> DSparkStats:
        s = SpecStats.combine([c.stats for c in (choices or self.choices.values())])
        return DSparkStats(accepted_length=s.accepted_length, verify_rounds=s.verify_rounds,
                           drafted_tokens=s.drafted_tokens, accepted_tokens=s.accepted_tokens)

    # ---- logprobs in OpenAI's two shapes ----

    def _chat_logprobs(self, ids, lps, tops) -> ChatLogprobs:
        def entry(t: int, lp: float) -> TopLogprob:
            s = self.token_texts(t)
            return TopLogprob(token=s, logprob=_finite(lp), bytes=list(s.encode("utf-8")))
        content = []
        for t, lp, top in zip(ids, lps, tops):
            e = entry(t, lp)
            content.append(ChatTokenLogprob(token=e.token, logprob=e.logprob, bytes=e.bytes,
                                            top_logprobs=[entry(k, v) for k, v in top.items()]))
        return ChatLogprobs(content=content)

    def _completion_logprobs(self, c: _Choice, ids, lps, tops) -> CompletionLogprobs:
        tokens, offsets = [], []
        for t in ids:
            tokens.append(self.token_texts(t))
            offsets.append(c.text_len)
            c.text_len += len(tokens[-1])
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[_finite(lp) for lp in lps], text_offset=offsets,
            top_logprobs=[{self.token_texts(k): _finite(v) for k, v in top.items()}
                          for top in tops])

    def _logprobs(self, c: _Choice, ids, lps, tops):
        if lps is None:
            return None
        tops = tops or [{} for _ in lps]
        if self.kind == "chat":
            return self._chat_logprobs(ids, lps, tops)
        return self._completion_logprobs(c, ids, lps, tops)

    # ---- streaming ----

    def first_chunks(self) -> list[str]:
        """Chat streams open each choice with the assistant role (OpenAI)."""
        if self.kind != "chat":
            return []
        return [ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[
            ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))
        ]).model_dump_json() for c in self.choices.values()]

    def chunk(self, out: RequestOutput) -> str | None:
        """SSE payload for one delta, or None if it carries nothing to send."""
        c = self.add(out)
        if not (out.new_text or out.finished or (out.new_logprobs and out.new_token_ids)):
            return None
        logprobs = self._logprobs(c, out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
        finish = c.finish_reason
        dspark = self.dspark([c]) if out.finished else None
        if self.kind == "chat":
            return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[
                ChatChunkChoice(index=c.index, delta=DeltaMessage(content=out.new_text),
                                logprobs=logprobs, finish_reason=finish)], dspark=dspark
            ).model_dump_json()
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[
            CompletionChoice(index=c.index, text=out.new_text, logprobs=logprobs,
                             finish_reason=finish)], dspark=dspark).model_dump_json()

    def usage_chunk(self) -> str:
        """Final chunk of a stream with ``stream_options.include_usage``: no choices, usage and
        the request's speculative statistics."""
        cls = ChatCompletionChunk if self.kind == "chat" else CompletionResponse
        return cls(id=self.id, created=self.created, model=self.model, choices=[],
                   usage=self.usage(), dspark=self.dspark()).model_dump_json()

    # ---- non-streamed ----

    def response(self) -> ChatCompletionResponse | CompletionResponse:
        choices = []
        for c in self.choices.values():
            text = "".join(c.text)
            logprobs = self._logprobs(c, c.token_ids, c.logprobs if self.want_logprobs else None,
                                      c.top_logprobs)
            if self.kind == "chat":
                choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=text),
                                          logprobs=logprobs, finish_reason=c.finish_reason))
            else:
                choices.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs,
                                                finish_reason=c.finish_reason))
        cls = ChatCompletionResponse if self.kind == "chat" else CompletionResponse
        return cls(id=self.id, created=self.created, model=self.model, choices=choices,
                   usage=self.usage(), dspark=self.dspark())
