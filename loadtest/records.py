"""One streamed chat completion, measured: SSE lines in, a per-request record out.

Definitions (as in vLLM's and SGLang's serving benchmarks):
- TTFT: seconds from sending the request to the first non-empty content delta.
- TPOT: (end-to-end latency - TTFT) / (completion tokens - 1), seconds per output token after
  the first; with speculation several tokens arrive per chunk, so chunk gaps are not tokens.
- tok/s/user: 1 / TPOT, the per-user generation speed of the paper's Pareto frontier (Fig. 8).
Completion tokens and the server's per-request ``dspark`` stats come from the final chunks
(``stream_options.include_usage``); without usage the content-chunk count stands in.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

DSPARK_FIELDS = ("accepted_length", "verify_rounds", "drafted_tokens", "accepted_tokens")


@dataclass
class RequestRecord:
    """Per-request measurements; times are Unix seconds, durations seconds."""

    prompt_set: str
    max_tokens: int
    t_start: float
    t_end: float = 0.0
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    tok_s_user: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    accepted_length: float | None = None
    verify_rounds: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass
class StreamTracker:
    """Feeds on the SSE lines of one ``/v1/chat/completions`` stream as they arrive."""

    prompt_set: str
    max_tokens: int
    t_start: float
    t_first: float | None = None
    content_chunks: int = 0
    done: bool = False
    error: str = ""
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    dspark: dict = field(default_factory=dict)

    def feed(self, line: bytes | str, now: float) -> None:
        """One line of the response body, received at Unix time ``now``. Non-``data:`` lines
        (blank separators, comments) are ignored; a malformed payload becomes the error."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        if not line.startswith("data:"):
            return
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            self.error = self.error or f"malformed SSE payload: {payload[:200]}"
            return
        if "error" in obj:
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        for choice in obj.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                self.t_first = self.t_first if self.t_first is not None else now
                self.content_chunks += 1
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if obj.get("usage"):
            self.usage = obj["usage"]
        if obj.get("dspark"):
            self.dspark = obj["dspark"]

    def record(self, t_end: float, error: str = "") -> RequestRecord:
        """The finished request's record; ``error`` (e.g. an HTTP status) marks it failed, as
        does a stream that ended without ``[DONE]`` or with an error object."""
        error = error or self.error or ("" if self.done else "stream ended without [DONE]")
        tokens = int(self.usage.get("completion_tokens", self.content_chunks))
        rec = RequestRecord(self.prompt_set, self.max_tokens, self.t_start, t_end, ok=not error,
                            error=error, e2e_s=t_end - self.t_start, completion_tokens=tokens,
                            prompt_tokens=self.usage.get("prompt_tokens"),
                            finish_reason=self.finish_reason)
        if self.t_first is not None:
            rec.ttft_s = self.t_first - self.t_start
            if tokens >= 2 and t_end > self.t_first:
                rec.tpot_s = (t_end - self.t_first) / (tokens - 1)
                rec.tok_s_user = 1.0 / rec.tpot_s
        for key in DSPARK_FIELDS:
            setattr(rec, key, self.dspark.get(key))
        return rec


def read_records(path) -> list[dict]:
    """Records of a JSONL file written by the Locust file (missing file: none)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
