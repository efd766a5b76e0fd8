"""Anchor sampling and block layout for training (paper Section 3.3; DeepSpec's anchor sampler).

A training sequence is prompt + response; only response tokens are supervised (the loss mask).
An anchor is a response position p whose next token is also in the response, matching serving,
where every anchor is a token the target emitted. Block slot j of the anchor at p holds the
anchor token (j = 0) or the mask token (j >= 1) at position p + j. Draft k = 1..gamma is read
from slot label_offset + k - 1 and predicts the token at p + k; the target distribution it is
trained against is the target's next-token distribution at position p + k - 1.

Visibility (the attention mask): a block sees the target context at positions < p (strictly
before its anchor, whose own target pass has not happened yet at serving time) and every slot
of its own block (bidirectional), nothing of other blocks. ``attention_mask`` spells this out
as one packed [R*G, L + R*G] matrix, the layout DeepSpec's ``create_dspark_attention_mask``
builds; the training forward uses the equivalent per-block ``ctx_mask`` of the backbone.

Shape symbols: S sequences, R blocks (all sequences), G block slots, gamma draft positions,
L context positions (the longest sequence).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p with loss_mask[p] and loss_mask[p + 1]: [T] bool -> [n] int64 (ascending).
    Raises ValueError for a non-bool or non-1-D mask."""
    if loss_mask.dim() != 1 or loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be bool [T], got {loss_mask.dtype} "
                         f"{tuple(loss_mask.shape)}")
    return torch.nonzero(loss_mask[:-1] & loss_mask[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to ``num_anchors`` distinct anchor positions drawn uniformly without replacement
    from ``anchor_candidates(loss_mask)``; [A] int64 ascending (A = min(num_anchors, n)).
    Raises ValueError for num_anchors < 1."""
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    cand = anchor_candidates(loss_mask)
    if cand.numel() <= num_anchors:
        return cand
    pick = torch.randperm(cand.numel(), generator=generator)[:num_anchors]
    return cand[pick].sort().values


@dataclass
class BlockLayout:
    """R training blocks over S sequences.

    seq_index:        [R] int64 sequence of each block.
    anchor_positions: [R] int64 anchor position p (also the number of visible context positions).
    input_ids:        [R, G] int64 anchor token, then mask tokens.
    positions:        [R, G] int64 p + j.
    labels:           [R, gamma] int64 token at p + k (0 where past the sequence end).
    label_mask:       [R, gamma] bool, label k exists and is supervised, prefix-closed in k.
    target_index:     [R, gamma] int64 position p + k - 1 whose target distribution draft k
                      is trained against (clamped into the sequence; masked where invalid).
    """

    seq_index: torch.Tensor
    anchor_positions: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    target_index: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.seq_index.numel())

    def context_mask(self, ctx_len: int) -> torch.Tensor:
        """[R, ctx_len] bool: context position i is visible to block r iff i < p_r."""
        return torch.arange(ctx_len, device=self.anchor_positions.device) < \
            self.anchor_positions[:, None]

    def to(self, device: torch.device | str) -> "BlockLayout":
        """The same layout with every tensor on ``device``."""
        return BlockLayout(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def block_layout(sequences: list[torch.Tensor], loss_masks: list[torch.Tensor],
                 anchors: list[torch.Tensor], *, block_size: int, label_offset: int,
                 mask_token_id: int) -> BlockLayout:
    """Lay out the blocks of every (sequence, anchor) pair, sequence by sequence.

    Args:
        sequences: S tensors [T_s] int64; loss_masks: S tensors [T_s] bool.
        anchors: S tensors [A_s] int64 of positions from ``sample_anchors``.
        block_size: G slots per block; label_offset: 0 (DeepSpec) or 1 (DFlash).
    Raises:
        ValueError: mismatched lengths, or an anchor that is not a valid candidate.
    """
    if not len(sequences) == len(loss_masks) == len(anchors):
        raise ValueError("sequences, loss_masks and anchors must have one entry per sequence")
    gamma = block_size - label_offset
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in
                                            ("seq", "anchor", "labels", "mask", "target")}
    for s, (ids, mask, anc) in enumerate(zip(sequences, loss_masks, anchors)):
        if ids.shape != mask.shape:
            raise ValueError(f"sequence {s}: ids {tuple(ids.shape)} vs loss mask "
                             f"{tuple(mask.shape)}")
        valid = torch.zeros_like(mask)
        valid[anchor_candidates(mask)] = True
        if anc.numel() and not bool(valid[anc].all()):
            raise ValueError(f"sequence {s}: anchors {anc.tolist()} include non-candidates")
        t = ids.numel()
        label_pos = anc[:, None] + torch.arange(1, gamma + 1, device=anc.device)  # [A, gamma]
        inside = label_pos < t
        safe = label_pos.clamp(max=t - 1)
        supervised = (inside & mask[safe]).long().cumprod(dim=1).bool()
        parts["seq"].append(torch.full_like(anc, s))
        parts["anchor"].append(anc)
        parts["labels"].append(torch.where(inside, ids[safe], 0))
        parts["mask"].append(supervised)
        parts["target"].append(safe - 1)
    anchor = torch.cat(parts["anchor"])
    anchor_tokens = torch.cat([ids[a] for ids, a in zip(sequences, anchors)])
    offsets = torch.arange(block_size, device=anchor.device)
    input_ids = torch.where(offsets == 0, anchor_tokens[:, None], mask_token_id)
    return BlockLayout(seq_index=torch.cat(parts["seq"]), anchor_positions=anchor,
                       input_ids=input_ids, positions=anchor[:, None] + offsets,
                       labels=torch.cat(parts["labels"]), label_mask=torch.cat(parts["mask"]),
                       target_index=torch.cat(parts["target"]))


def attention_mask(layout: BlockLayout, seq_lengths: torch.Tensor) -> torch.Tensor:
    """The packed mask of one sequence's blocks, DeepSpec's layout: queries are the R*G block
    slots, keys are the L context positions followed by the R*G block slots.

    Args:
        layout: blocks of ONE sequence (all seq_index equal).
        seq_lengths: [1] int64, that sequence's length L.
    Returns:
        [R*G, L + R*G] bool, True = may attend.
    """
    if layout.num_blocks and int(layout.seq_index.max()) != int(layout.seq_index.min()):
        raise ValueError("attention_mask takes the blocks of a single sequence")
    r, g = layout.input_ids.shape
    ctx_len = int(seq_lengths[0])
    dev = layout.input_ids.device
    block_of_query = torch.arange(r * g, device=dev) // g
    ctx = (torch.arange(ctx_len, device=dev)[None, :]
           < layout.anchor_positions[block_of_query][:, None])
    own = block_of_query[:, None] == block_of_query[None, :]
    return torch.cat([ctx, own], dim=1)
