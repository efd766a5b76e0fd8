"""Training targets of one cached sequence in draft space: the labels ``draft_space_loss``
takes, built from the cache's final hidden states (``feature_cache``) and the draft
vocabulary's LM-head rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_serve.training.anchors import block_layout
from dspark_serve.training.feature_cache import CachedSequence, target_logits_rows


@dataclass
class DraftSpaceTargets:
    """target_probs [A, gamma, N] float32 p_t on the draft vocabulary; greedy [A, gamma]
    int64 draft index of the target's greedy token (-1: outside); label_mask [A, gamma] bool."""

    target_probs: torch.Tensor
    greedy: torch.Tensor
    label_mask: torch.Tensor


def draft_index_map(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] int64: the draft index of each target token, -1 outside the draft vocabulary.
    draft_ids: [N] int64 target ids of the draft vocabulary."""
    index = torch.full((vocab_size,), -1, dtype=torch.int64, device=draft_ids.device)
    index[draft_ids] = torch.arange(draft_ids.numel(), device=draft_ids.device)
    return index


def sequence_targets(seq: CachedSequence, anchors: torch.Tensor, *, block_size: int,
                     label_offset: int, head_rows: torch.Tensor,
                     to_draft: torch.Tensor) -> DraftSpaceTargets:
    """Targets of the blocks anchored at ``anchors`` ([A] int64, anchor candidates of
    ``seq.loss_mask``): draft k trains against the target's distribution at position
    p + k - 1 (``anchors.block_layout``), labels past the response are masked.

    Args:
        head_rows: [N, d] LM-head rows of the draft vocabulary.
        to_draft: [V] int64 from ``draft_index_map``.
    Raises:
        ValueError: an anchor that is not a candidate (from ``block_layout``).
    """
    layout = block_layout([seq.ids], [seq.loss_mask], [anchors], block_size=block_size,
                          label_offset=label_offset, mask_token_id=0)
    index = layout.target_index                                           # [A, gamma]
    # each position's distribution once, however many blocks read it
    lo, hi = int(index.min()), int(index.max()) + 1
    rows = (target_logits_rows(seq.final[lo:hi], head_rows) - seq.lse[lo:hi, None]).exp_()
    return DraftSpaceTargets(target_probs=rows[index - lo], greedy=to_draft[seq.greedy[index]],
                             label_mask=layout.label_mask)
