"""Per-request state of the embedded engine.

A request's tokens are ``prompt_ids + output_ids``. The target K/V cache holds the first
``num_computed`` of them. While decoding, exactly one token lacks K/V: the last output token,
which is the anchor of the next verify round (its target forward happens together with the
drafts that follow it). A request preempted for KV pages (``LLMEngine``) restarts at
``num_computed = 0`` and prefills all its tokens but that anchor again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark_serve.engine.detokenizer import IncrementalDetokenizer
from dspark_serve.engine.outputs import SpecStats
from dspark_serve.engine.params import SamplingParams
from dspark_serve.structured.compiler import GrammarState


@dataclass(eq=False)
class Request:
    """One engine request (one completion choice)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1                  # KV cache slot while running, -1 while waiting
    num_computed: int = 0           # tokens with target K/V (and drafter context)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None
    emitted_tokens: int = 0         # output tokens already returned in a RequestOutput
    emitted_logprobs: int = 0
    grammar: GrammarState | None = None  # at the committed output; None = unconstrained

    @property
    def output_format(self) -> str:
        """Metrics label of the request's output: "text", "json" or "regex"."""
        return "text" if self.params.structured is None else self.params.structured.format

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens that need target K/V before the request decodes: its prompt, or after a
        preemption every token but the last (the next anchor)."""
        return self.num_tokens - 1 if self.output_ids else len(self.prompt_ids)

    @property
    def prefilling(self) -> bool:
        """True until every token of ``prefill_len`` has target K/V."""
        return self.num_computed < self.prefill_len

    @property
    def anchor(self) -> int:
        """The token the next verify round starts from (the last committed token)."""
        return self.output_ids[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    def record_round(self, drafted: int, accepted: int) -> None:
        """Update tau = tokens committed per verify round (accepted drafts + one target token)."""
        s = self.stats
        s.verify_rounds += 1
        s.drafted_tokens += drafted
        s.accepted_tokens += accepted
        s.accepted_length = (s.accepted_tokens + s.verify_rounds) / s.verify_rounds
