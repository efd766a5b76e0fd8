"""Anchor sampling, block layout and the block attention mask against explicit references."""
import pytest
import torch

from dspark_serve.training.anchors import (anchor_candidates, attention_mask, block_layout,
                                           sample_anchors)

MASK = 99


def test_anchor_candidates_need_anchor_and_next_token_in_response():
    #                        0  1  2  3  4  5  6  7
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    assert anchor_candidates(mask).tolist() == [2, 3, 6]


def test_sample_anchors_distinct_sorted_subset_and_seeded():
    mask = torch.zeros(40, dtype=torch.bool)
    mask[10:] = True
    cand = set(range(10, 39))
    a = sample_anchors(mask, 8, torch.Generator().manual_seed(3))
    b = sample_anchors(mask, 8, torch.Generator().manual_seed(3))
    assert a.tolist() == b.tolist()
    assert len(set(a.tolist())) == 8 and set(a.tolist()) <= cand
    assert a.tolist() == sorted(a.tolist())
    # fewer candidates than asked: all of them
    assert sample_anchors(mask, 100).tolist() == sorted(cand)
    # every candidate is reachable, roughly uniformly (29 candidates, 8 draws, 600 trials:
    # expected count per candidate 165.5, sd ~11; 5 sd bounds)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(40)
    for _ in range(600):
        counts[sample_anchors(mask, 8, g)] += 1
    assert counts[:10].sum() == 0 and counts[39] == 0
    assert counts[10:39].min() > 110 and counts[10:39].max() < 221
    with pytest.raises(ValueError):
        sample_anchors(mask, 0)


def test_block_layout_matches_hand_written_reference():
    ids = [torch.tensor([10, 11, 12, 13, 14, 15, 16]), torch.tensor([20, 21, 22, 23, 24])]
    masks = [torch.tensor([0, 0, 1, 1, 1, 1, 1], dtype=torch.bool),
             torch.tensor([0, 1, 1, 1, 0], dtype=torch.bool)]
    anchors = [torch.tensor([2, 4]), torch.tensor([1])]
    lay = block_layout(ids, masks, anchors, block_size=3, label_offset=0, mask_token_id=MASK)
    assert lay.seq_index.tolist() == [0, 0, 1]
    assert lay.anchor_positions.tolist() == [2, 4, 1]
    assert lay.input_ids.tolist() == [[12, MASK, MASK], [14, MASK, MASK], [21, MASK, MASK]]
    assert lay.positions.tolist() == [[2, 3, 4], [4, 5, 6], [1, 2, 3]]
    # draft k predicts the token at anchor + k; past the end -> 0 and masked; sequence 1's
    # position 4 is not response, so its third label is masked
    assert lay.labels.tolist() == [[13, 14, 15], [15, 16, 0], [22, 23, 24]]
    assert lay.label_mask.tolist() == [[True] * 3, [True, True, False], [True, True, False]]
    assert lay.target_index.tolist() == [[2, 3, 4], [4, 5, 5], [1, 2, 3]]
    # DFlash alignment: one more slot, same gamma labels
    lay1 = block_layout(ids, masks, anchors, block_size=4, label_offset=1, mask_token_id=MASK)
    assert lay1.labels.tolist() == lay.labels.tolist()
    assert lay1.positions.tolist()[0] == [2, 3, 4, 5]


def test_block_layout_rejects_non_candidate_anchor():
    ids = [torch.arange(6)]
    masks = [torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.bool)]
    with pytest.raises(ValueError, match="non-candidates"):
        block_layout(ids, masks, [torch.tensor([1])], block_size=2, label_offset=0,
                     mask_token_id=MASK)
    with pytest.raises(ValueError, match="non-candidates"):
        block_layout(ids, masks, [torch.tensor([5])], block_size=2, label_offset=0,
                     mask_token_id=MASK)


def test_attention_mask_matches_explicit_reference():
    ids = [torch.arange(12)]
    masks = [torch.tensor([0] * 3 + [1] * 9, dtype=torch.bool)]
    anchors = [torch.tensor([3, 7, 9])]
    g = 4
    lay = block_layout(ids, masks, anchors, block_size=g, label_offset=0, mask_token_id=MASK)
    got = attention_mask(lay, torch.tensor([12]))
    n_ctx, r = 12, 3
    ref = torch.zeros(r * g, n_ctx + r * g, dtype=torch.bool)
    for q in range(r * g):
        block = q // g
        for kv in range(n_ctx + r * g):
            if kv < n_ctx:
                ref[q, kv] = kv < [3, 7, 9][block]        # strictly before the anchor
            else:
                ref[q, kv] = (kv - n_ctx) // g == block    # own block, both directions
    assert torch.equal(got, ref)
    # the per-block context mask the training forward uses is the context part of it
    assert torch.equal(lay.context_mask(n_ctx), got[::g, :n_ctx])
