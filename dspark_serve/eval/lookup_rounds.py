"""Prompt-lookup and corpus-lookup rounds replayed on the target's greedy outputs: the data
of their survival tables (``calibration.lookup``) and of their offline acceptance.

At temperature 0 a draft token is accepted exactly when it equals the target's greedy token,
so rounds can be replayed on a plain greedy output without running the target again: from
the anchor (the first output token) draft, accept the matching prefix, commit it plus the
next target token (p -> p + n + 1), as the engine's rounds with full verification do.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from dspark_serve.drafter.corpus_lookup import CorpusIndex
from dspark_serve.drafter.prompt_lookup import DEFAULT_MAX_NGRAM, prompt_lookup


def greedy_lookup_rounds(prompt: list[int], output: list[int], gamma: int,
                         max_ngram: int = DEFAULT_MAX_NGRAM
                         ) -> tuple[list[int], list[int], list[int]]:
    """Rounds of prompt-lookup drafting over one greedy output (module docstring).

    Args:
        prompt, output: token ids; the output is the target's greedy continuation.
        gamma: most draft tokens per round (fewer near the end of the output).
    Returns:
        (match_len, num_drafted, num_accepted) per round, rounds without a match included
        with match length 0 and 0 drafts.
    """
    def draft(text: np.ndarray, n: int) -> tuple[list[int], int]:
        found = prompt_lookup(text, n, max_ngram)
        return found.tokens, found.match_len
    return _greedy_rounds(prompt, output, gamma, draft)


def greedy_corpus_rounds(prompt: list[int], output: list[int], gamma: int, corpus: CorpusIndex
                         ) -> tuple[list[int], list[int], list[int]]:
    """Rounds of corpus-lookup drafting (``drafter.corpus_lookup``) over one greedy output, as
    ``greedy_lookup_rounds``; the first list holds each round's support key (0: no draft)."""
    def draft(text: np.ndarray, n: int) -> tuple[list[int], int]:
        found = corpus.draft(text.tolist(), n)
        return found.tokens, found.key
    return _greedy_rounds(prompt, output, gamma, draft)


def _greedy_rounds(prompt: list[int], output: list[int], gamma: int,
                   draft: Callable[[np.ndarray, int], tuple[list[int], int]]
                   ) -> tuple[list[int], list[int], list[int]]:
    """(key, num_drafted, num_accepted) per round of ``draft(text so far, most tokens) ->
    (tokens, key)`` walked over a greedy output (module docstring)."""
    text = np.asarray(prompt + output, dtype=np.int64)
    p, end = len(prompt), len(prompt) + len(output)
    m, d, a = [], [], []
    while p < end - 1:
        tokens, key = draft(text[:p + 1], min(gamma, end - 1 - p))
        n = 0
        while n < len(tokens) and tokens[n] == text[p + 1 + n]:
            n += 1
        m.append(key), d.append(len(tokens)), a.append(n)
        p += n + 1
    return m, d, a
