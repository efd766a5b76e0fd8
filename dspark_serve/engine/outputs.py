"""What the engine hands back: per-request output deltas, per-request speculative statistics,
and per-step statistics for the metrics exporter."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class SpecStats:
    """Speculative-decoding statistics of one request so far.

    verify_rounds: verify rounds the request took part in (decode steps with speculation).
    drafted_tokens: draft tokens proposed to it (gamma per drafting round).
    accepted_tokens: draft tokens accepted by rejection sampling (bonus/recovered tokens excluded).
    accepted_length: tau, tokens committed per verify round including the bonus or recovered
        token, i.e. (accepted_tokens + verify_rounds) / verify_rounds; 0 before the first round.
    """

    accepted_length: float = 0.0
    verify_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @staticmethod
    def combine(stats: list["SpecStats"]) -> "SpecStats":
        """Totals over several requests (the choices of one HTTP request); tau is the
        round-weighted mean."""
        rounds = sum(s.verify_rounds for s in stats)
        tau = sum(s.accepted_length * s.verify_rounds for s in stats) / rounds if rounds else 0.0
        return SpecStats(accepted_length=tau, verify_rounds=rounds,
                         drafted_tokens=sum(s.drafted_tokens for s in stats),
                         accepted_tokens=sum(s.accepted_tokens for s in stats))


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request (a delta, not the running total).

    new_token_ids: tokens committed this step (several per verify round under speculation; none
        past a stop string, stop token or max_tokens).
    new_text: exact text delta (stop strings excluded; concatenating all deltas gives the text).
    new_logprobs: log-probability of each new token under the target's raw distribution
        (log-softmax of the logits before penalties, logit bias, temperature and top-k/top-p/
        min-p, as vLLM reports by default), aligned with new_token_ids; None unless the request
        asked for logprobs.
    new_top_logprobs: per new token, {token id: logprob} of the top_logprobs most likely tokens;
        None unless the request asked for logprobs.
    finished / finish_reason: "stop" (stop string, stop token or EOS), "length" (max_tokens or the
        context limit), "abort" (aborted); None while running.
    prompt_tokens / completion_tokens: totals so far. stats: the request's SpecStats so far.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)


@dataclass(slots=True)
class StepStats:
    """What one engine step did, for the Prometheus exporter (``dspark_serve.server.metrics``).

    num_running / num_waiting: requests scheduled in / queued after this step.
    verify_tokens: verify budget B of the step, target positions spent on verification
        (sum over decoding requests of l_r + 1; 0 without speculation).
    drafted_tokens / accepted_tokens: draft tokens proposed / accepted this step.
    accepted_per_position: [gamma] verify rounds whose draft at position k+1 was accepted.
    verified_per_position: [gamma] verify rounds whose draft at position k+1 was verified
        (l_r >= k+1); with accepted_per_position gives the per-position acceptance rate.
    rounds: verify rounds this step (one per decoding request with speculation).
    generated_tokens: tokens committed this step (all requests, incl. bonus tokens).
    step_seconds: wall time of the step.
    grammar_seconds: time spent on grammar masks this step (drafts and verify positions).
    rounds_by_format: verify rounds, drafted and accepted tokens of this step split by the
        requests' output format ("text", "json", "regex").
    """

    num_running: int = 0
    num_waiting: int = 0
    verify_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)
    rounds: int = 0
    generated_tokens: int = 0
    step_seconds: float = 0.0
    grammar_seconds: float = 0.0
    rounds_by_format: dict[str, SpecStats] = field(default_factory=dict)


class RequestFailed(RuntimeError):
    """Raised by ``LLMEngine.step`` when processing of one request failed and the engine has
    dropped that request. ``outputs`` carries the step's outputs for the other requests (which
    must be unaffected); the server reports the error to the failed request only."""

    def __init__(self, request_id: str, message: str, outputs: list[RequestOutput] | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.outputs = list(outputs or [])
