"""Incremental detokenization with exact stop-string handling.

Tokens are appended one at a time (also when a verify round accepts several), so a stop string
that ends inside an accepted block stops the request at exactly that token: no later token ids,
logprobs or text are returned. The stop string itself is not part of the text (OpenAI).
While a request runs, the tail that could still become a stop string or is an incomplete UTF-8
sequence is held back, so streamed text never has to be taken back.
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of one request's output tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        stop: stop strings (empty strings are ignored).
    """

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters already returned by pop_delta

    def append(self, token_id: int) -> bool:
        """Add one token; returns True if a stop string completed (text is then cut before it)."""
        self.token_ids.append(int(token_id))
        checked = len(self.text)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if not self.stop:
            return False
        # a few characters of slack: a trailing partial UTF-8 sequence may decode differently now
        start = max(0, min(checked, len(self.text)) - self.max_stop - 4)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return True
        return False

    def pop_delta(self, finished: bool) -> str:
        """Text not yet returned that can no longer change (all of it once finished)."""
        end = len(self.text)
        if not finished:
            end -= max(self.max_stop - 1, 0)
            while end > self.sent and self.text[end - 1] == REPLACEMENT_CHAR:
                end -= 1
        if end <= self.sent:
            return ""
        delta = self.text[self.sent:end]
        self.sent = end
        return delta
