"""SpecMetadata of a mixed step, against hand-computed offsets and logit indices."""
import torch

from dspark_serve.engine.batch import plan_step
from dspark_serve.engine.params import SamplingParams
from dspark_serve.engine.request import Request
from dspark_serve.types import DraftBlock
from dspark_serve.verify.metadata import SpecMetadata


def _request(name, prompt_len, output=(), computed=0, slot=0):
    r = Request(name, list(range(10, 10 + prompt_len)), SamplingParams(), None)
    r.output_ids, r.num_computed, r.slot = list(output), computed, slot
    return r


def test_build_places_rows_by_hand():
    # rows: a decoding request with l = 2 at flat 0, one with l = 0 at flat 3, a completed
    # prompt whose last token is flat 11 (an unfinished chunk at 4..8 has no row)
    meta = SpecMetadata.build([0, 3, 11], [2, 0, 0], torch.zeros(3, 2, dtype=torch.int64), None,
                              2, "cpu")
    assert meta.num_rows == 3 and meta.gamma == 2
    assert meta.offsets == [0, 3, 4]
    assert meta.logit_indices.tolist() == [0, 1, 2, 3, 11]
    assert meta.logit_rows.tolist() == [0, 0, 0, 1, 2]
    assert meta.logit_cols.tolist() == [0, 1, 2, 0, 0]
    assert meta.verify_lengths.tolist() == [2, 0, 0]
    assert meta.verify_lengths.dtype == meta.logit_indices.dtype == torch.int64


def test_mixed_prefill_and_decode_step():
    a = _request("a", 4, output=[7], computed=4, slot=0)        # decoding, anchor 7 at pos 4
    b = _request("b", 3, output=[8, 9], computed=4, slot=1)     # decoding, anchor 9 at pos 4
    c = _request("c", 6, computed=0, slot=2)                    # prompt completes: 6 tokens
    d = _request("d", 9, computed=0, slot=3)                    # chunk of 2 of 9: no row
    plan = plan_step([a, b, c, d], prefill_chunk=8)
    assert plan.decode == [a, b] and plan.prefill == [(c, 6), (d, 2)]
    assert plan.prefill_done == [c]
    plan.gamma, plan.lengths = 3, torch.tensor([3, 1])
    plan.block = DraftBlock(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.zeros(2, 3, 5),
                            torch.zeros(2, 3))
    ids, slots, pos, starts = plan.flat_tokens()
    # a: anchor + 3 drafts at 0..3; b: anchor + 1 draft at 4..5; c: 6 tokens at 6..11; d: 12..13
    assert ids[:6] == [7, 1, 2, 3, 9, 4] and starts == [0, 4, 6, 12]
    assert pos[:6] == [4, 5, 6, 7, 4, 5] and slots[:6] == [0, 0, 0, 0, 1, 1]
    first = plan.verify_first_tokens(starts)
    assert first == [0, 4, 11]
    drafts, probs = plan.verify_drafts(torch.device("cpu"))
    meta = SpecMetadata.build(first, [3, 1, 0], drafts, probs, plan.gamma, "cpu")
    assert meta.offsets == [0, 4, 6]
    assert meta.logit_indices.tolist() == [0, 1, 2, 3, 4, 5, 11]
    assert meta.logit_rows.tolist() == [0, 0, 0, 0, 1, 1, 2]
    assert meta.logit_cols.tolist() == [0, 1, 2, 3, 0, 1, 0]
    assert meta.drafts.tolist() == [[1, 2, 3], [4, 5, 6], [0, 0, 0]]
    assert meta.draft_probs.shape == (3, 3, 5)
