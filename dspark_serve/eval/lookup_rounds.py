"""Prompt-lookup rounds replayed on the target's greedy outputs: the data of the lookup
survival table (``calibration.lookup``) and of lookup's offline acceptance.

At temperature 0 a draft token is accepted exactly when it equals the target's greedy token,
so rounds can be replayed on a plain greedy output without running the target again: from
the anchor (the first output token) draft, accept the matching prefix, commit it plus the
next target token (p -> p + n + 1), as the engine's rounds with full verification do.
"""
from __future__ import annotations

import numpy as np

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
    text = np.asarray(prompt + output, dtype=np.int64)
    p, end = len(prompt), len(prompt) + len(output)
    m, d, a = [], [], []
    while p < end - 1:
        draft = prompt_lookup(text[:p + 1], min(gamma, end - 1 - p), max_ngram)
        n = 0
        while n < len(draft.tokens) and draft.tokens[n] == text[p + 1 + n]:
            n += 1
        m.append(draft.match_len), d.append(len(draft.tokens)), a.append(n)
        p += n + 1
    return m, d, a
