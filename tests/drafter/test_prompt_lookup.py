"""Prompt lookup: longest suffix match, most recent on a tie, loops continued past the end,
no draft without a match."""
import numpy as np
import pytest

from dspark_serve.drafter.prompt_lookup import LookupDraft, prompt_lookup


@pytest.mark.parametrize("text, gamma, expected", [
    # suffix [2, 3, 4] matches at 1..3 and 6..8; the later one wins, continues 7, 8, 2
    ([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4], 3, LookupDraft([7, 8, 2], 3)),
    # the longest match wins over a more recent shorter one: [5, 6] at 0..1 vs [6] at 3
    ([5, 6, 1, 6, 2, 5, 6], 2, LookupDraft([1, 6], 2)),
    # a loop of period 3 continues with the draft's own tokens past the text's end
    ([5, 6, 7, 5], 5, LookupDraft([6, 7, 5, 6, 7], 1)),
    ([3, 3, 3, 3], 4, LookupDraft([3, 3, 3, 3], 3)),
    ([1, 2, 3], 4, LookupDraft([], 0)),           # the anchor never occurred before
    ([7], 4, LookupDraft([], 0)),
    ([1, 1], 0, LookupDraft([], 0)),
])
def test_prompt_lookup_cases(text, gamma, expected):
    assert prompt_lookup(np.array(text), gamma) == expected


def test_max_and_min_ngram():
    text = np.array([1, 2, 3, 9, 1, 2, 3])
    assert prompt_lookup(text, 2, max_ngram=2) == LookupDraft([9, 1], 2)
    assert prompt_lookup(text, 2, min_ngram=4) == LookupDraft([], 0)
    with pytest.raises(ValueError, match="min_ngram"):
        prompt_lookup(text, 2, min_ngram=0)
