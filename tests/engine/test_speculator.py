"""The speculator's proposers without the real model: prompt lookup alone (rows without a
match verify nothing), hybrid routing (the drafter drafts only the rows lookup does not take)
and the survival pool handed to the scheduler."""
import math

import pytest
import torch

from dspark_serve.calibration.lookup import LookupCalibration
from dspark_serve.drafter.corpus_lookup import CorpusIndex, num_keys, support_key
from dspark_serve.engine.speculator import LookupConfig, Speculator
from dspark_serve.types import SamplingTensors
from tests.drafter.conftest import tiny_config, tiny_drafter

V = 61
CAL = LookupCalibration([[0.5, 0.5, 0.5], [0.9, 0.8, 0.7]])


def speculator(drafter=None, scheduler="static", gamma=3):
    return Speculator(drafter, lookup=LookupConfig(min_match=2, calibration=CAL), vocab_size=V,
                      gamma=gamma, scheduler=scheduler, cost_table=None, temperatures=None,
                      threshold=0.6, max_batch_tokens=None, num_slots=4, max_len=32)


TEXTS = [[1, 2, 3, 9, 1, 2],        # suffix [1, 2] matched at 0: drafts 3 9 1 (match 2)
         [4, 5, 6, 7],              # no earlier 7: no draft
         [8, 3, 8]]                 # [8] matched at 0: drafts 3 8 3 (match 1)


def propose(spec, caps=(3, 3, 3), uniforms_cols=0, **kwargs):
    r = len(TEXTS)
    args = (torch.arange(r), torch.tensor([t[-1] for t in TEXTS]),
            torch.tensor([len(t) - 1 for t in TEXTS]), TEXTS, SamplingTensors.uniform(r, 0.0),
            torch.full((r, uniforms_cols), 0.5), torch.tensor(caps))
    return spec.propose(*args, **kwargs)


def test_lookup_alone_verifies_found_tokens_only():
    block, lengths = propose(speculator())
    assert lengths.tolist() == [3, 0, 3]
    assert block.tokens[0].tolist() == [3, 9, 1] and block.tokens[2].tolist() == [3, 8, 3]
    assert block.probs is None            # one-hot at the tokens, built only where needed
    assert block.tokens[1].tolist() == [0, 0, 0]
    _, capped = propose(speculator(), caps=(1, 3, 0))
    assert capped.tolist() == [1, 0, 0]


def test_lookup_survival_feeds_the_scheduler():
    """threshold 0.6: the match-2 row's c = 0.9, 0.8, 0.7 keeps 3; the match-1 row's 0.5 none."""
    _, lengths = propose(speculator(scheduler="threshold"))
    assert lengths.tolist() == [3, 0, 0]


def test_lookup_survival_follows_verified_rounds():
    """The match-2 row's drafts keep being rejected at position 1: its survival falls from the
    table's 0.9, 0.8, 0.7 below the threshold (0.6), the last position first, until the
    scheduler stops verifying it; outcomes of rows lookup did not draft, or of a step without a
    proposal, count nothing."""
    spec = speculator(scheduler="threshold")
    verified = []
    for _ in range(20):
        _, lengths = propose(spec)
        assert lengths[1:].tolist() == [0, 0]
        verified.append(int(lengths[0]))
        if not verified[-1]:
            break
        spec.observe(lengths, [0, 0, 0])
    assert verified[0] == 3 and verified[-1] == 0 and verified == sorted(verified, reverse=True)
    rounds = len(verified) - 1
    reached = spec.lookup_survival.reached.copy()
    spec.observe(torch.tensor([3, 3, 3]), [3, 3, 3])           # no proposal since: ignored
    assert (spec.lookup_survival.reached == reached).all() and reached.sum() == rounds
    # position 1 of match 2: (20 * shifted prior + 0 accepted) / (20 + rounds) < 0.6
    shifted = 1 / (1 + math.exp(-(math.log(9) + spec.lookup_survival.shift)))
    c = spec.lookup_survival.confidence(torch.tensor([2]), 3)[0, 0]
    assert c == pytest.approx(20 * shifted / (20 + rounds)) and c < 0.6


def test_hybrid_drafts_only_rows_lookup_does_not_take(monkeypatch):
    drafter = tiny_drafter(tiny_config(block_size=3), seed=2)
    spec = speculator(drafter)
    taps = torch.randn(12, drafter.config.context_dim)
    spec.extend(torch.tensor([0] * 5 + [1] * 3 + [2] * 2 + [3] * 2),
                torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0, 1]), taps)
    seen = []
    draft = drafter.draft
    monkeypatch.setattr(drafter, "draft", lambda cache, slots, *a: seen.append(slots.tolist())
                        or draft(cache, slots, *a))
    block, lengths = propose(spec, uniforms_cols=drafter.gamma)
    assert seen == [[1, 2]]          # row 0 matched 2 tokens (lookup); rows 1, 2 by the drafter
    assert block.tokens[0].tolist() == [3, 9, 1]
    assert lengths.tolist() == [3, 3, 3]                   # static: every drafted row in full
    assert torch.allclose(block.probs[1:].sum(-1), torch.ones(2, 3))


def test_hybrid_without_its_drafter_verifies_what_lookup_alone_would():
    """The drafter does not run this step: row 2's one-token match (left to the drafter,
    min_match 2) is verified by lookup, exactly as by prompt lookup alone."""
    drafter = tiny_drafter(tiny_config(block_size=3), seed=2)
    block, lengths = propose(speculator(drafter), uniforms_cols=drafter.gamma,
                             drafter_runs=False)
    alone_block, alone = propose(speculator())
    assert lengths.tolist() == alone.tolist() == [3, 0, 3]
    assert torch.equal(block.tokens, alone_block.tokens) and block.probs is None


def _hybrid(drafter):
    spec = speculator(drafter)
    spec.extend(torch.tensor([0] * 5 + [1] * 3 + [2] * 2),
                torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 0, 1]),
                torch.randn(10, drafter.config.context_dim))
    return spec


def test_hybrid_counts_its_drafter_rows_outcomes():
    """Rows 1 and 2 (the drafter's) accept 2 and 1 of 3: drafter survival counts reached [2,
    2, 1], accepted [2, 1, 0]; row 0 (lookup, match 2) counts into lookup's table only."""
    drafter = tiny_drafter(tiny_config(block_size=3), seed=2)
    spec = _hybrid(drafter)
    _, lengths = propose(spec, uniforms_cols=drafter.gamma)
    assert spec._drafter_gain() is None
    spec.observe(lengths, [0, 2, 1])
    assert spec.drafter_survival.reached.tolist() == [[2, 2, 1]]
    assert spec.drafter_survival.accepted.tolist() == [[2, 1, 0]]
    assert spec.lookup_survival.reached.tolist() == [[0, 0, 0], [1, 0, 0]]
    table = spec.drafter_survival.table()[0].double()
    assert spec._drafter_gain() == pytest.approx(float(table.cumprod(0).sum()))


@pytest.mark.parametrize("drafter_accepts, row0_by", [(3, "drafter"), (0, "lookup")])
def test_hybrid_leaves_a_match_to_the_drafter_expected_to_get_more_accepted(
        monkeypatch, drafter_accepts, row0_by):
    """Row 0's match of 2 tokens expects 0.9 + 0.72 + 0.504 = 2.124 accepted drafts. After 200
    verified drafter rounds that accepted all 3 drafts (expected ~3), the drafter drafts row 0
    too; after 200 that accepted none (~0), lookup keeps it."""
    drafter = tiny_drafter(tiny_config(block_size=3), seed=2)
    spec = _hybrid(drafter)
    assert spec.lookup_drafts([0, 1, 2], TEXTS).gain == pytest.approx([2.124, 0.0, 0.875])
    spec.drafter_survival.observe([1] * 200, [3] * 200, [drafter_accepts] * 200)
    seen = []
    draft = drafter.draft
    monkeypatch.setattr(drafter, "draft", lambda cache, slots, *a: seen.append(slots.tolist())
                        or draft(cache, slots, *a))
    block, _ = propose(spec, uniforms_cols=drafter.gamma)
    assert seen == ([[0, 1, 2]] if row0_by == "drafter" else [[1, 2]])
    assert (block.tokens[0].tolist() == [3, 9, 1]) == (row0_by == "lookup")


def _cached_context(spec, slots):
    lengths = spec.cache.lengths[slots]
    return lengths.tolist(), [c[i, :n] for c in spec.cache.context(0, slots, int(lengths.max()))
                              for i, n in enumerate(lengths.tolist())]


def test_a_reused_slot_drops_its_last_requests_pending_taps():
    """Slot 0's request leaves with 5 taps still pending and a new request takes the slot:
    after the flush, slots 0 and 1 hold exactly what a speculator that only ever saw the new
    request (and slot 1) holds, bit for bit."""
    drafter = tiny_drafter(tiny_config(block_size=3), seed=2)
    taps = torch.randn(11, drafter.config.context_dim)
    spec, fresh = speculator(drafter), speculator(drafter)
    spec.extend(torch.tensor([0] * 5 + [1] * 3), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]), taps[:8])
    spec.reset_slot(0)
    spec.extend(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 3]), taps[8:])
    fresh.extend(torch.tensor([1] * 3), torch.tensor([0, 1, 2]), taps[5:8])
    fresh.extend(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 3]), taps[8:])
    spec.flush()
    fresh.flush()
    (lengths, ctx), (want_lengths, want) = (_cached_context(s, torch.tensor([0, 1]))
                                            for s in (spec, fresh))
    assert lengths == want_lengths == [2, 4]
    assert all(torch.equal(a, b) for a, b in zip(ctx, want))


@pytest.mark.parametrize("lookup", [True, False])
def test_a_drafter_that_does_not_draft_gives_up_the_waiting_contexts(monkeypatch, lookup):
    """Once more than MAX_PENDING_TOKENS taps wait (no draft for that long: many users), the
    slots waiting lose their drafter context instead of paying its projection: nothing of
    theirs is projected or kept, the drafter drafts only the other rows (hybrid: prompt
    lookup still serves them; DSpark alone: they verify nothing), and a new request in the
    slot starts a context again."""
    monkeypatch.setattr("dspark_serve.engine.speculator.MAX_PENDING_TOKENS", 6)
    drafter = tiny_drafter(tiny_config(block_size=3), seed=2)
    spec = speculator(drafter) if lookup else Speculator(
        drafter, vocab_size=V, gamma=3, scheduler="static", cost_table=None, temperatures=None,
        threshold=0.6, max_batch_tokens=None, num_slots=4, max_len=32)
    c = drafter.config.context_dim
    spec.extend(torch.tensor([0] * 5 + [1] * 3), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]),
                torch.randn(8, c))                          # 8 > 6 waiting: slots 0, 1 dropped
    spec.extend(torch.tensor([2, 2, 1]), torch.tensor([0, 1, 3]), torch.randn(3, c))
    assert spec._pending_tokens == 2                        # slot 1's new token is not kept
    seen = []
    draft = drafter.draft
    monkeypatch.setattr(drafter, "draft", lambda cache, slots, *a: seen.append(slots.tolist())
                        or draft(cache, slots, *a))
    block, lengths = propose(spec, uniforms_cols=drafter.gamma)
    assert seen == [[2]]
    assert lengths.tolist() == ([3, 0, 3] if lookup else [0, 0, 3])
    assert spec.cache.lengths.tolist() == [0, 0, 2, 0]      # slot 2 projected for its draft
    spec.reset_slot(1)                                      # a new request takes slot 1
    spec.extend(torch.tensor([1, 0]), torch.tensor([0, 5]), torch.randn(2, c))
    assert spec._pending_tokens == 1


def test_nothing_to_verify_is_a_plain_step():
    """No row has a lookup match and no drafter runs: no block at all (the engine then takes
    a plain decode step), every length 0, and no lookup round to learn from; a row that
    matched but may verify nothing (cap 0) is such a step too."""
    spec = speculator(scheduler="threshold")
    texts = [[4, 5, 6, 7], [1, 2, 3]]
    args = (torch.arange(2), torch.tensor([7, 3]), torch.tensor([3, 2]), texts,
            SamplingTensors.uniform(2, 0.0), torch.zeros(2, 0), torch.tensor([3, 3]))
    block, lengths = spec.propose(*args)
    assert block is None and lengths.tolist() == [0, 0]
    spec.observe(lengths, [0, 0])                     # nothing recorded, nothing raised
    block, lengths = propose(spec, caps=(0, 3, 0))     # rows 0 and 2 match, capped at 0
    assert block is None and lengths.tolist() == [0, 0, 0]
    block, lengths = propose(spec)
    assert block is not None and lengths.tolist() == [3, 0, 0]


def test_lookup_drafts_the_scheduler_admits_none_of_make_a_plain_step():
    """Threshold 0.95: rows 0 and 2 match (survival 0.9 and 0.5) but none is admitted, so
    no block (a plain decode step, no empty verify round) and no lookup round to learn from;
    the caller's own ``lookup_drafts`` of the step gives the same proposal as propose's."""
    spec = speculator(scheduler="threshold")
    spec.scheduler.threshold = 0.95
    block, lengths = propose(spec)
    assert block is None and lengths.tolist() == [0, 0, 0]
    assert spec._lookup_rounds is None
    found = speculator().lookup_drafts([0, 1, 2], TEXTS)
    assert (found.tokens, found.found, found.match_len) == (
        [[3, 9, 1], [0, 0, 0], [3, 8, 3]], [3, 0, 3], [2, 0, 1])
    r = len(TEXTS)
    block, lengths = speculator().propose(
        torch.arange(r), torch.tensor([t[-1] for t in TEXTS]),
        torch.tensor([len(t) - 1 for t in TEXTS]), TEXTS, SamplingTensors.uniform(r, 0.0),
        torch.zeros(r, 0), torch.tensor([3, 3, 3]), found)
    assert lengths.tolist() == [3, 0, 3] and block.tokens[2].tolist() == [3, 8, 3]


def test_served_step_time_reaches_the_scheduler_without_drafting():
    """The engine's step wall time, less the step's own drafting, prices B; a step with
    prefill tokens prices nothing; schedulers without ``observe_step`` are left alone."""
    drafter = tiny_drafter(tiny_config(block_size=3), seed=2)
    spec = speculator(drafter)
    spec.extend(torch.tensor([0] * 5 + [1] * 3 + [2] * 2 + [3] * 2),
                torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0, 1]),
                torch.randn(12, drafter.config.context_dim))
    spec.observe_step(4, 1.0)                         # static scheduler: nothing to tell

    class Recorder:
        def __init__(self, inner):
            self.inner, self.seen = inner, []

        def __call__(self, confidence):
            return self.inner(confidence)

        def observe_step(self, batch_tokens, seconds):
            self.seen.append((batch_tokens, seconds))

    spec.scheduler = Recorder(spec.scheduler)
    propose(spec, uniforms_cols=drafter.gamma)        # the drafter drafts rows 1 and 2
    drafted = spec._step_draft_seconds
    assert drafted > 0
    spec.observe_step(9, 1.0)
    spec.observe_step(3, 1.0)                         # a plain step: nothing drafted
    spec.observe_step(None, 1.0)                      # prefill tokens shared the step
    assert spec.scheduler.seen == [(9, pytest.approx(1.0 - drafted)), (3, 1.0)]


def test_async_scheduler_drafts_only_the_positions_it_may_verify():
    """The drafter drafts the scheduler's ``draft_width`` positions (K + 1), the block is
    padded to gamma with zeros, no row verifies past the width, and the draft's time is
    recorded for that width."""
    from dspark_serve.scheduling import CostTable
    drafter = tiny_drafter(tiny_config(block_size=4), seed=2)
    spec = Speculator(drafter, vocab_size=V, gamma=4, scheduler="async",
                      cost_table=CostTable((1, 64), (1.0, 1.0), 64), temperatures=None,
                      threshold=0.6, max_batch_tokens=None, num_slots=4, max_len=32)
    spec.extend(torch.tensor([0] * 5 + [1] * 3), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]),
                torch.randn(8, drafter.config.context_dim))
    widths = []
    draft = drafter.draft
    drafter.draft = lambda *args: widths.append(args[-1].shape[1]) or draft(*args)
    spec.scheduler.draft_width = lambda num_drafted, known: 2
    block, lengths = spec.propose(torch.tensor([0, 1]), torch.tensor([3, 4]),
                                  torch.tensor([5, 3]), [[1] * 6, [2] * 4],
                                  SamplingTensors.uniform(2, 0.0), torch.full((2, 4), 0.5),
                                  torch.tensor([4, 4]))
    assert widths == [2]
    assert block.tokens.shape == (2, 4) and block.tokens[:, 2:].eq(0).all()
    assert block.conf_logits[:, 2:].eq(0).all() and block.tokens[:, :2].ne(0).any()
    assert lengths.le(2).all() and lengths.sum() > 0  # flat prices: every drafted slot pays
    assert list(spec.scheduler._draft_seconds[2]) == [2]


# ---- corpus lookup beside prompt lookup (hybrid) ----
# Corpus contexts for TEXTS: row 0 ([.., 1, 2]) none; row 1 ([.., 7]) drafts 20 21 22 from a
# context seen once (key 2); row 2 ([.., 3, 8]) drafts 30 31 after a context always followed by
# 30 (n = 2, key 8).
CORPUS = CorpusIndex([[7, 20, 21, 22]] + [[3, 8, 30, 31]] * 3)


def corpus_speculator(drafter=None, key2=0.3, key8=0.9, scheduler="threshold"):
    table = [[0.5] * 3 for _ in range(num_keys(CORPUS.max_ngram))]
    table[1], table[7] = [key2] * 3, [key8] * 3
    return Speculator(drafter, lookup=LookupConfig(min_match=2, calibration=CAL, corpus=CORPUS,
                                                   corpus_calibration=LookupCalibration(table)),
                      vocab_size=V, gamma=3, scheduler=scheduler, cost_table=None,
                      temperatures=None, threshold=0.6, max_batch_tokens=None, num_slots=4,
                      max_len=32)


def test_a_row_takes_the_draft_expected_to_survive_longer():
    """Row 0: lookup (match 2: 0.9 + 0.72 + 0.5 expected) and no corpus draft; row 1: only
    the corpus's (0.3 each: below the threshold); row 2: the corpus's 30 31 (0.9 + 0.81 over
    its 2 drafts) beats lookup's one-token match (0.5 + 0.25 + 0.125)."""
    spec = corpus_speculator()
    found = spec.lookup_drafts([0, 1, 2], TEXTS)
    assert found.from_corpus == [False, True, True] and found.found == [3, 3, 2]
    assert found.match_len == [2, support_key(1, 1, 1, 6), support_key(2, 3, 3, 6)] == [2, 2, 8]
    block, lengths = propose(spec)
    assert block.tokens.tolist() == [[3, 9, 1], [20, 21, 22], [30, 31, 0]]
    assert lengths.tolist() == [3, 0, 2]
    weak = corpus_speculator(key8=0.2).lookup_drafts([0, 1, 2], TEXTS)
    assert weak.from_corpus[2] is False and weak.tokens[2] == [3, 8, 3]


def test_corpus_outcomes_update_the_corpus_survival_only():
    spec = corpus_speculator()
    _, lengths = propose(spec)
    spec.observe(lengths, [3, 0, 1])
    assert spec.lookup_survival.reached[1].tolist() == [1, 1, 1]       # row 0: match 2
    assert spec.corpus_survival.reached[7].tolist() == [1, 1, 0]       # row 2: key 8, 2 drafts
    assert spec.corpus_survival.accepted[7].tolist() == [1, 0, 0]
    assert spec.lookup_survival.reached.sum() == 3 and spec.corpus_survival.reached.sum() == 2


def test_hybrid_gives_a_corpus_row_to_the_drafter_until_it_is_known_to_survive_less(
        monkeypatch):
    """First draft: rows 1 and 2 (corpus candidates) are the drafter's, whose survival is not
    known yet; once its rows' outcomes are (one accepted of three each: ~0.7 expected), row 2's
    corpus draft (survival 1.0: 2 expected over its 2 drafts) beats it, row 1's (0.0) does
    not."""
    drafter = tiny_drafter(tiny_config(block_size=3), seed=2)
    spec = corpus_speculator(drafter, key2=0.0, key8=1.0, scheduler="static")
    spec.extend(torch.tensor([0] * 5 + [1] * 3 + [2] * 2),
                torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 0, 1]),
                torch.randn(10, drafter.config.context_dim))
    seen = []
    draft = drafter.draft
    monkeypatch.setattr(drafter, "draft", lambda cache, slots, *a: seen.append(slots.tolist())
                        or draft(cache, slots, *a))
    _, lengths = propose(spec, uniforms_cols=drafter.gamma)
    assert seen == [[1, 2]]
    spec.observe(lengths, [3, 1, 1])
    assert 0 < spec._drafter_gain() < 2
    block, _ = propose(spec, uniforms_cols=drafter.gamma)
    assert seen == [[1, 2], [1]] and block.tokens[2].tolist() == [30, 31, 0]
