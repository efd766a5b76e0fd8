from dspark_serve.engine.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """Token id i is the i-th character of ``alphabet``; ids >= 200 are UTF-8 bytes of 'é'."""

    alphabet = "abcdefghijklmnopqrstuvwxyz .!"

    def decode(self, ids, skip_special_tokens=True):
        raw = b"".join(self.alphabet[i].encode() if i < 200 else {200: b"\xc3", 201: b"\xa9"}[i]
                       for i in ids)
        return raw.decode("utf-8", errors="replace")


def ids(text):
    return [CharTokenizer.alphabet.index(c) for c in text]


def feed(detok, token_ids):
    for k, t in enumerate(token_ids):
        if detok.append(t):
            return k
    return None


def test_stop_string_inside_a_block_cuts_text_and_tokens_exactly():
    d = IncrementalDetokenizer(CharTokenizer(), stop=["lo w"])
    stopped_at = feed(d, ids("hello world"))
    assert stopped_at == ids("hello world").index(ids("w")[0])  # the token that completed "lo w"
    assert d.text == "hel"
    assert d.pop_delta(finished=True) == "hel"


def test_streamed_deltas_hold_back_a_possible_stop_prefix():
    d = IncrementalDetokenizer(CharTokenizer(), stop=["xyz"])
    deltas = []
    for t in ids("abxy"):
        assert not d.append(t)
        deltas.append(d.pop_delta(finished=False))
    assert "".join(deltas) == "ab"          # "xy" may still become "xyz"
    assert d.append(ids("q")[0]) is False
    assert d.pop_delta(finished=True) == "xyq"


def test_incomplete_utf8_is_held_until_complete():
    d = IncrementalDetokenizer(CharTokenizer())
    d.append(ids("a")[0])
    d.append(200)                            # first byte of 'é'
    assert d.pop_delta(finished=False) == "a"
    d.append(201)                            # second byte
    assert d.pop_delta(finished=False) == "é"
