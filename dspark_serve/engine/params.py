"""Per-request sampling parameters of the embedded engine (OpenAI semantics plus vLLM-style
extensions: top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos; structured outputs).

Speculation never changes what these mean: every parameter acts on the target distribution at
each verified position exactly as in one-token-at-a-time decoding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dspark_serve.structured.spec import GrammarSpec

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1


class InvalidParameter(ValueError):
    """A request parameter is out of range; ``param`` names it (OpenAI error ``param`` field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(name, f"Invalid type for '{name}': expected an integer, but got "
                                     f"{type(value).__name__} instead.")
    return value


def _check_range(name: str, value: object, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    """Raise InvalidParameter unless ``lo <= value <= hi`` (``lo < value`` if ``lo_open``).
    NaN fails every comparison, so it is rejected too."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameter(name, f"Invalid type for '{name}': expected a number, but got "
                                     f"{type(value).__name__} instead.")
    kind = "integer" if isinstance(value, int) else "decimal"
    if lo is not None and not (value > lo if lo_open else value >= lo):
        op = ">" if lo_open else ">="
        raise InvalidParameter(name, f"Invalid '{name}': {kind} below minimum value. Expected a "
                                     f"value {op} {lo:g}, but got {value} instead.")
    if (hi is not None and not value <= hi) or (hi is None and not math.isfinite(value)):
        bound = f"<= {hi:g}" if hi is not None else "to be finite"
        raise InvalidParameter(name, f"Invalid '{name}': {kind} above maximum value. Expected a "
                                     f"value {bound}, but got {value} instead.")


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request (one completion choice).

    n: number of choices requested (the server expands n > 1 into n engine requests).
    max_tokens: most completion tokens to generate (>= 1).
    temperature: 0 = greedy; in [0, 2]. top_p in (0, 1], 1 = off. top_k >= 0, 0 or -1 = off.
    min_p in [0, 1], 0 = off (relative to the top token's probability).
    stop: strings that end the completion (excluded from the text); stop_token_ids: token ids
    that end it. ignore_eos: keep generating past the tokenizer's EOS.
    seed: per-request RNG seed (None = the engine's global RNG).
    frequency_penalty / presence_penalty in [-2, 2] (OpenAI, subtracted from logits);
    repetition_penalty > 0, 1 = off (CTRL-style, divides positive logits).
    logit_bias: token id -> bias in [-100, 100] added to the target logits.
    logprobs: return the log-probability of each sampled token; top_logprobs: also the top
    0..20 alternatives per position (requires logprobs).
    structured: the grammar the output must match (JSON object / schema, regex), or None.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    structured: GrammarSpec | None = None

    def validate(self, vocab_size: int) -> None:
        """Check every field against its range for a vocabulary of ``vocab_size`` tokens.

        Raises InvalidParameter (a ValueError) with an OpenAI-style message naming the field.
        Normalises ``top_k == -1`` (vLLM's "off") to 0.
        """
        _check_range("n", _check_int("n", self.n), 1, MAX_N)
        _check_range("max_tokens", _check_int("max_tokens", self.max_tokens), 1)
        _check_range("temperature", self.temperature, 0.0, 2.0)
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if _check_int("top_k", self.top_k) == -1:
            self.top_k = 0
        _check_range("top_k", self.top_k, 0)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, lo_open=True)
        if self.seed is not None:
            _check_range("seed", _check_int("seed", self.seed), SEED_MIN, SEED_MAX)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParameter("stop", "Invalid 'stop': every stop sequence must be a "
                                               "non-empty string.")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise InvalidParameter("stop_token_ids", f"Invalid 'stop_token_ids': {t!r} is not "
                                       f"a token id (expected an integer in [0, {vocab_size})).")
        for tok, bias in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
                raise InvalidParameter("logit_bias", f"Invalid key in 'logit_bias': {tok!r}. Keys "
                                       f"must be token ids in [0, {vocab_size}).")
            _check_range("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        _check_range("top_logprobs", _check_int("top_logprobs", self.top_logprobs), 0,
                     MAX_TOP_LOGPROBS)
        if self.top_logprobs > 0 and not self.logprobs:
            raise InvalidParameter("top_logprobs", "Invalid 'top_logprobs': requires 'logprobs' "
                                                   "to be enabled.")
