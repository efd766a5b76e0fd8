"""Corpus lookup: drafts equal a brute-force n-gram table's, support keys, the corpus file."""
import collections
import random

import numpy as np
import pytest

from dspark_serve.drafter.corpus_lookup import (CorpusIndex, load_corpus, num_keys, save_corpus,
                                                support_key)
from dspark_serve.eval.lookup_rounds import greedy_corpus_rounds


def reference_draft(sequences, max_ngram, text, num_tokens):
    """The most frequent successor (smaller id on ties) of the longest context, by counting."""
    table = collections.defaultdict(collections.Counter)
    for seq in sequences:
        for j in range(len(seq) - 1):
            for n in range(1, min(max_ngram, j + 1) + 1):
                table[tuple(seq[j - n + 1:j + 1])][seq[j + 1]] += 1
    text, out = list(text), []
    for _ in range(num_tokens):
        for n in range(min(max_ngram, len(text)), 0, -1):
            counts = table.get(tuple(text[-n:]))
            if counts:
                best = max(counts.values())
                out.append(min(t for t, c in counts.items() if c == best))
                text.append(out[-1])
                break
        else:
            break
    return out


def test_drafts_equal_a_counted_table():
    rng = random.Random(0)
    sequences = [[rng.randrange(6) for _ in range(rng.randrange(0, 40))] for _ in range(50)]
    for max_ngram in (1, 3):
        index = CorpusIndex(sequences, max_ngram)
        for _ in range(500):
            text = [rng.randrange(7) for _ in range(rng.randrange(1, 8))]   # 6: never seen
            assert index.draft(text, 5).tokens == reference_draft(sequences, max_ngram, text, 5)


def test_first_draft_key_and_chain():
    """[1, 2] is followed by 3 twice and 4 once: share 2/3, seen 3 times -> band 3 of n = 2;
    the chain goes on from [2, 3] (followed by 5 once) and stops at an unseen tail."""
    index = CorpusIndex([[1, 2, 3, 5], [1, 2, 3], [1, 2, 4]], max_ngram=2)
    draft = index.draft([9, 1, 2], 4)
    assert draft.tokens == [3, 5] and draft.key == support_key(2, 2, 3, 2) == 7
    assert index.draft([9, 9], 4).tokens == [] and index.draft([9, 9], 4).key == 0
    assert index.draft([1, 2], 0).tokens == []


@pytest.mark.parametrize("n, count, total, key", [(1, 1, 1, 2), (1, 3, 3, 4), (1, 1, 3, 1),
                                                  (2, 2, 3, 7), (3, 1, 2, 10), (4, 9, 10, 16),
                                                  (6, 9, 10, 16)])
def test_support_keys(n, count, total, key):
    """Bands: share < 0.5 -> 1, seen once or twice -> 2, share < 0.8 -> 3, else 4; n capped at
    max_ngram."""
    assert support_key(n, count, total, max_ngram=4) == key
    assert 1 <= key <= num_keys(4) == 16


def test_corpus_file_round_trip(tmp_path):
    sequences = [[5, 6, 7], [], [1]]
    save_corpus(tmp_path / "c.npz", sequences, {"model": "m"})
    loaded, meta = load_corpus(tmp_path / "c.npz")
    assert [s.tolist() for s in loaded] == sequences and meta == {"model": "m"}
    np.savez(tmp_path / "bad.npz", tokens=np.zeros(3, np.int32), starts=np.array([0, 5]),
             meta=np.array("{}"))
    with pytest.raises(ValueError, match="not a corpus file"):
        load_corpus(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match="not a corpus file"):
        load_corpus(tmp_path / "missing.npz")


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_ngram"):
        CorpusIndex([[1, 2]], max_ngram=0)
    with pytest.raises(ValueError, match=">= 0"):
        CorpusIndex([[1, -2]])
    with pytest.raises(ValueError, match="num_tokens"):
        CorpusIndex([[1, 2]]).draft([1], -1)


def test_greedy_corpus_rounds_walk_the_output():
    """Corpus [7, 8, 9]: from the anchor 7 it drafts 8 9, both the target's (p -> p + 3); from
    the anchor 1 nothing (key 0, no drafts)."""
    index = CorpusIndex([[7, 8, 9]], max_ngram=2)
    keys, drafted, accepted = greedy_corpus_rounds([4], [7, 8, 9, 1, 5], gamma=3, corpus=index)
    assert (keys, drafted, accepted) == ([support_key(1, 1, 1, 2), 0], [2, 0], [2, 0])
