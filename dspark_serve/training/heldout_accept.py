"""Exact T = 0 acceptance of a drafter on held-out target text, from a feature cache (the
model-selection metric of issue 15; not MT-Bench).

For every anchor p of a held-out sequence (the target's own greedy answers, cached by
``cache-features``), draft k is accepted at T = 0 iff the drafter's argmax, teacher-forced on
the text's tokens, is the target's greedy token at p + k - 1 (``CachedSequence.greedy``), and
all drafts before it were. Reported: position-1 acceptance, conditional acceptance per
position (accepted at k given accepted up to k - 1) and the mean tokens per round
1 + accepted length (full-gamma verification, bonus included).
"""
from __future__ import annotations

import torch

from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.training.anchors import anchor_candidates, block_layout
from dspark_serve.training.feature_cache import FeatureCache
from dspark_serve.training.shared_context import shared_context_forward

_ANCHOR_CHUNK = 256


@torch.no_grad()
def heldout_acceptance(drafter: DSparkDrafter, cache: FeatureCache | list, *,
                       max_seqs: int | None = None, tap_scale: torch.Tensor | None = None,
                       autocast: bool = True) -> dict:
    """Acceptance over every anchor of the first ``max_seqs`` cached sequences (all if None),
    computed on the drafter's device (``cache``: a ``FeatureCache`` or a list of
    ``CachedSequence``).

    Args:
        drafter: any drafter with a vanilla Markov head or none (pruned vocabulary or full).
        tap_scale: [C] tap normalisation not yet folded into fc (training), or None.
        autocast: run under bf16 autocast (as training does).
    Returns:
        {"pos1": float, "cond_accept": [gamma] (NaN where no anchor got that far),
         "tau": float, "anchors": int, "sequences": int}.
    """
    cfg = drafter.config
    vocab = drafter.draft_vocab
    matched, supervised, taus = [], [], []
    n = len(cache) if max_seqs is None else min(max_seqs, len(cache))
    was_training = drafter.training
    drafter.eval()
    device = drafter.backbone.fc.weight.device
    for i in range(n):
        seq = cache[i].to(device)
        anchors = anchor_candidates(seq.loss_mask)
        anchors = anchors[anchors >= 1]
        if anchors.numel() == 0:
            continue
        draft = []
        # anchors in chunks: [A * gamma, N] logits of a whole sequence would take gigabytes
        for part in anchors.split(_ANCHOR_CHUNK):
            with torch.autocast(seq.taps.device.type, dtype=torch.bfloat16, enabled=autocast):
                logits, _, _ = shared_context_forward(drafter, seq.taps, seq.ids, part,
                                                      tap_scale=tap_scale)
            draft.append(logits.argmax(-1))
        draft = torch.cat(draft)
        layout = block_layout([seq.ids], [seq.loss_mask], [anchors],
                              block_size=cfg.block_size, label_offset=cfg.label_offset,
                              mask_token_id=cfg.mask_token_id)
        if vocab is not None:
            draft = vocab[draft]
        match = (draft == seq.greedy[layout.target_index]) & layout.label_mask
        matched.append(match)
        supervised.append(layout.label_mask)
        taus.append(1 + match.long().cumprod(1).sum(1))
    drafter.train(was_training)
    match, mask = torch.cat(matched), torch.cat(supervised)
    prefix = match.long().cumprod(1).bool()
    reached = torch.cat([mask[:, :1], prefix[:, :-1] & mask[:, 1:]], dim=1)
    cond = (prefix & reached).sum(0).float() / reached.sum(0).clamp_min(1)
    cond[reached.sum(0) == 0] = float("nan")
    return {"pos1": float(match[:, 0].float().mean()), "cond_accept": cond.tolist(),
            "tau": float(torch.cat(taus).float().mean()), "anchors": int(match.shape[0]),
            "sequences": len(matched)}
