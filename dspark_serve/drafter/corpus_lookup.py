"""Corpus lookup: drafts from the target's own earlier answers to other prompts.

Prompt lookup (``prompt_lookup``) only finds text the request has already seen. Much of what a
small chat model writes is also predictable from the few tokens before it across all its
answers (the rest of a split word, "```python" after "```", its stock phrases). A corpus of the
target's answers to unrelated prompts (ShareGPT first turns, answered greedily by the target:
``dspark-serve corpus``) gives, for every context of n = 1..max_ngram tokens seen in it,
the token that most often followed (ties: the smaller id) and how often. A draft extends the
request's text one token at a time with the longest context seen in the corpus, up to gamma
tokens; like a prompt-lookup draft it is a deterministic function of the text, so its draft
probability is one-hot and rejection sampling stays lossless at any temperature. What predicts
acceptance is the first draft's context: its length n and how often its token followed it
(``support_key``); ``calibration.lookup`` learns survival per key as for prompt lookup's match
lengths. Drafting costs a few dict probes per token (no model: tens of microseconds for 7
tokens). SuffixDecoding (Oliaro et al., 2024; vLLM's ``suffix`` method) drafts the
same way from a suffix tree of the server's own earlier outputs; here the corpus is built
offline and fixed, so a benchmark that repeats its prompts never drafts from its own answers.

Contexts are stored as 64-bit polynomial hashes salted by n (one dict for all n); a collision
can only produce a wrong draft, which verification rejects.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_MAX_NGRAM = 6
FILE_NAME = "corpus.npz"
_BASE = 0x100000001B3        # hash multiplier (FNV-64 prime); token t enters as t + 1
_MASK = (1 << 64) - 1
# packed table values: next token | count << 24 | total << 48 (Python ints: no overflow)
_COUNT_SHIFT, _TOTAL_SHIFT = 24, 48
_FIELD = (1 << 24) - 1
# survival keys: 4 bands per context length n = 1..max_ngram (``support_key``)
_SHARES, _BANDS = (0.5, 0.8), 4


@dataclass(frozen=True)
class CorpusDraft:
    """tokens: up to gamma draft ids (empty: no context of the text's end is in the corpus).
    key: the survival key of the first draft (``support_key``; 0 without a draft)."""

    tokens: list[int]
    key: int


def support_key(n: int, count: int, total: int, max_ngram: int) -> int:
    """Survival key 1..4 * max_ngram of a draft whose first token followed its n-token context
    ``count`` of the ``total`` times the corpus has that context: (n - 1) * 4 + band, band 1
    for a share below 0.5, 2 for a context seen once or twice, 3 for a share below 0.8, else 4
    (measured on MT-Bench, 4-token contexts: position-1 acceptance 0.16 / 0.44 / 0.30 / 0.61).
    """
    share = count / total
    band = 1 if share < _SHARES[0] else 2 if total <= 2 else 3 if share < _SHARES[1] else 4
    return (min(n, max_ngram) - 1) * _BANDS + band


def num_keys(max_ngram: int) -> int:
    """Rows of a corpus survival table: keys 1..num_keys."""
    return max_ngram * _BANDS


class CorpusIndex:
    """Most frequent next token of every n-gram (n = 1..max_ngram) of a token corpus.

    Args:
        sequences: the corpus, token id sequences (contexts never span two sequences).
        max_ngram: longest context compared (>= 1).
    Raises:
        ValueError: max_ngram < 1, or a negative token id.
    """

    def __init__(self, sequences: list[list[int]] | list[np.ndarray],
                 max_ngram: int = DEFAULT_MAX_NGRAM):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.num_tokens = sum(len(s) for s in sequences)
        hashes, nexts = [], []
        for seq in sequences:
            seq = np.asarray(seq, dtype=np.int64)
            if seq.size and int(seq.min()) < 0:
                raise ValueError("token ids must be >= 0")
            shifted = (seq + 1).astype(np.uint64)
            power = 1
            with np.errstate(over="ignore"):
                for n in range(1, min(max_ngram, seq.size - 1) + 1):
                    # h[i] = hash of the context seq[j-n+1..j], j = n-1+i (followed by seq[j+1])
                    if n == 1:
                        h = shifted[:-1]
                    else:
                        power = power * _BASE & _MASK
                        h = h[1:] + shifted[:seq.size - n] * np.uint64(power)
                    hashes.append(_order_hash(h, n))
                    nexts.append(seq[n:])
        self._build(np.concatenate(hashes) if hashes else np.zeros(0, np.uint64),
                    np.concatenate(nexts) if nexts else np.zeros(0, np.int64))

    def _build(self, hashes: np.ndarray, nexts: np.ndarray) -> None:
        order = np.lexsort((nexts, hashes))
        hashes, nexts = hashes[order], nexts[order]
        pair_start = np.flatnonzero(np.r_[True, (hashes[1:] != hashes[:-1]) |
                                          (nexts[1:] != nexts[:-1])])
        pair_count = np.diff(np.r_[pair_start, hashes.size])
        ph, pn = hashes[pair_start], nexts[pair_start]
        # per context: the pair with the largest count (lexsort: count desc, then smaller id)
        by = np.lexsort((pn, -pair_count, ph))
        ph, pn, pair_count = ph[by], pn[by], pair_count[by]
        first = np.r_[True, ph[1:] != ph[:-1]]
        ctx_start = np.flatnonzero(first)
        totals = np.add.reduceat(pair_count, ctx_start) if ctx_start.size else pair_count[:0]
        # one dict probe per context length and draft token (~2 us a token): next token, count
        # and total packed into one int
        packed = [t + (min(c, _FIELD) << _COUNT_SHIFT) + (s << _TOTAL_SHIFT) for t, c, s in
                  zip(pn[first].tolist(), pair_count[first].tolist(), totals.tolist())]
        self._table: dict[int, int] = dict(zip(ph[first].tolist(), packed))

    @property
    def num_contexts(self) -> int:
        return len(self._table)

    def draft(self, text: list[int], num_tokens: int) -> CorpusDraft:
        """Extend ``text`` (token ids; the last is the anchor) by up to ``num_tokens`` tokens,
        each the most frequent successor of the longest context in the corpus.
        Raises ValueError for num_tokens < 0."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        tail = list(text[-self.max_ngram:])
        tokens, key = [], 0
        for _ in range(num_tokens):
            hit = self._longest(tail)
            if hit is None:
                break
            token, n, count, total = hit
            if not tokens:
                key = support_key(n, count, total, self.max_ngram)
            tokens.append(token)
            tail = tail[1:] + [token] if len(tail) == self.max_ngram else tail + [token]
        return CorpusDraft(tokens, key)

    def _longest(self, tail: list[int]) -> tuple[int, int, int, int] | None:
        """(next token, n, count, total) of the longest context ending ``tail`` in the corpus."""
        probes, h, power = [], 0, 1
        for n in range(1, len(tail) + 1):
            h = (h + (tail[-n] + 1) * power) & _MASK
            power = power * _BASE & _MASK
            probes.append(_order_hash(h, n))
        for n in range(len(probes), 0, -1):
            value = self._table.get(probes[n - 1])
            if value is not None:
                return (value & _FIELD, n, value >> _COUNT_SHIFT & _FIELD,
                        value >> _TOTAL_SHIFT)
        return None


def _order_hash(h, n: int):
    """Context hash h (int or uint64 array) made distinct per context length n."""
    salt = (n * 0x9E3779B97F4A7C15) & _MASK
    return h ^ np.uint64(salt) if isinstance(h, np.ndarray) else h ^ salt


def save_corpus(path: str | Path, sequences: list[list[int]], meta: dict) -> None:
    """Write a corpus file: ``tokens`` int32 [N] (the sequences concatenated), ``starts``
    int64 [S + 1] (sequence s is tokens[starts[s]:starts[s + 1]]), ``meta`` JSON (model,
    prompts, how generated)."""
    starts = np.cumsum([0] + [len(s) for s in sequences]).astype(np.int64)
    tokens = np.concatenate([np.asarray(s, dtype=np.int32) for s in sequences]) if sequences \
        else np.zeros(0, np.int32)
    np.savez_compressed(path, tokens=tokens, starts=starts, meta=np.array(json.dumps(meta)))


def load_corpus(path: str | Path) -> tuple[list[np.ndarray], dict]:
    """(sequences, meta) of a corpus file. Raises ValueError for a malformed file."""
    try:
        with np.load(path) as data:
            tokens, starts = data["tokens"], data["starts"]
            meta = json.loads(str(data["meta"]))
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not a corpus file ({exc})") from exc
    if starts.ndim != 1 or starts.size < 1 or starts[0] != 0 or starts[-1] != tokens.size \
            or np.any(np.diff(starts) < 0):
        raise ValueError(f"{path}: not a corpus file (bad sequence starts)")
    return [tokens[a:b] for a, b in zip(starts[:-1], starts[1:])], meta
