"""min-p correction, penalty caps and GenerationBatchResult fields (no sglang needed)."""
import math

import pytest
import torch

from dspark_serve.sglang_plugin.results import batch_result_fields
from dspark_serve.sglang_plugin.verify_fixes import draft_caps, min_p_masked_logits
from dspark_serve.types import VerifyResult


def test_min_p_mask_removes_exactly_the_tokens_below_min_p_times_max():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = min_p_masked_logits(logits, torch.tensor([1.0, 1.0]), torch.tensor([0.4, 0.0]))
    # Row 0: keep p >= 0.4 * 0.5 = 0.2 -> tokens 0, 1. Row 1: min_p off, unchanged.
    assert torch.isinf(out[0, 2:]).all() and torch.equal(out[0, :2], logits[0, :2])
    assert torch.equal(out[1], logits[1])
    # At temperature 2 the post-temperature probabilities are flatter: sqrt(p) normalised,
    # threshold 0.4 * sqrt(.5) = .283 relative -> sqrt(.15)=.387 kept, sqrt(.05)=.224 dropped.
    out_t = min_p_masked_logits(logits[:1], torch.tensor([2.0]), torch.tensor([0.4]))
    assert torch.isinf(out_t[0]).tolist() == [False, False, False, True]
    assert not math.isinf(float(min_p_masked_logits(logits[:1], torch.tensor([0.0]),
                                                    torch.tensor([0.9]))[0, 3]))


def test_draft_caps():
    assert draft_caps(5, torch.tensor([True, False])).tolist() == [0, 5]
    with pytest.raises(ValueError):
        draft_caps(5, torch.tensor([1, 0]))


def test_batch_result_fields():
    res = VerifyResult(num_accepted=torch.tensor([2, 0]),
                       tokens=torch.tensor([[7, 8, 9, -1], [4, -1, -1, -1]]),
                       num_tokens=torch.tensor([3, 1]))
    f = batch_result_fields(res, torch.tensor([3, 1]))
    assert f["accept_lens"].dtype == torch.int32 and f["accept_lens"].tolist() == [3, 1]
    assert f["cap_lens"].tolist() == [4, 2]
    assert f["next_token_ids"].tolist() == [7, 8, 9, -1, 4, -1, -1, -1]
    # SGLang's processor: num_correct_drafts = sum(accept_lens - 1) = 2.
    assert int((f["accept_lens"] - 1).sum()) == 2
    with pytest.raises(ValueError):
        batch_result_fields(res, torch.tensor([1, 1]))
