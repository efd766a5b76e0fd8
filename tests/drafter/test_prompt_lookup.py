"""Prompt lookup: longest suffix match, most recent on a tie, loops continued past the end,
no draft without a match; the incremental index equals the scan."""
import numpy as np
import pytest

from dspark_serve.drafter.prompt_lookup import LookupDraft, LookupIndex, prompt_lookup


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


@pytest.mark.parametrize("vocab, max_ngram, min_ngram", [(2, 8, 1), (3, 3, 2), (5, 1, 1),
                                                         (20, 8, 3)])
def test_lookup_index_equals_prompt_lookup_as_the_text_grows(vocab, max_ngram, min_ngram):
    """The incremental index drafts exactly what the scan drafts, at every length of a random
    text (small vocabularies: many overlapping matches of every length), any gamma."""
    rng = np.random.default_rng(vocab * 100 + max_ngram * 10 + min_ngram)
    index, text = LookupIndex(max_ngram, min_ngram), []
    for token, gamma in zip(rng.integers(0, vocab, 200).tolist(), rng.integers(0, 7, 200)):
        text.append(token)
        expected = prompt_lookup(np.array(text), int(gamma), max_ngram, min_ngram)
        assert index.draft(text, int(gamma)) == expected


def test_lookup_index_reindexes_a_different_text():
    """A text that does not extend the indexed one (shorter, or different anywhere: a new
    request in the slot) is indexed from scratch: no match comes from the old text."""
    index = LookupIndex()
    assert index.draft([4, 5, 6, 7, 4], 2) == LookupDraft([5, 6], 1)
    assert index.draft([1, 5], 2) == LookupDraft([], 0)                # shorter
    assert index.draft([1, 5, 9, 9, 2, 1, 5], 2) == LookupDraft([9, 9], 2)
    # same last indexed token, different start: (5, 9) only occurred in the old text
    assert index.draft([3, 3, 9, 9, 2, 1, 5, 9], 3) == LookupDraft([2, 1, 5], 1)
    with pytest.raises(ValueError, match="min_ngram"):
        LookupIndex(2, 3)
