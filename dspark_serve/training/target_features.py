"""The frozen target's side of a training step, computed on the fly (paper Section 3.3).

One target forward over the S training sequences (flat tokens, one KV slot each, no padding)
yields the hidden taps of every token (the drafter's context, Eq 2) and the target's logits at
the positions each draft is trained against. Nothing is cached between steps: a step holds
the taps of its own sequences only (S * L * n_taps * hidden values in the target dtype, e.g.
4 x 768 x 5 x 576 x 2 bytes = 17.7 MB in bf16) plus the target KV cache of those sequences
(2 * layers * S * L * kv_heads * head_dim values, 71 MB for SmolLM2-135M) and the
[R, gamma, V] float32 logits (88 MB for 64 blocks of 7 over a 49k vocabulary). Caching taps
and target distributions on disk instead would cost (n_taps + 1) * hidden * 2 bytes per token
(6.9 KB for SmolLM2-135M in bf16, storing the final hidden state and applying the LM head on
the fly), i.e. ~7 GB per million tokens, in exchange for one target pass per sequence instead
of one per epoch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_serve.model.target_model import TargetModel
from dspark_serve.training.anchors import BlockLayout


@dataclass
class TargetBatch:
    """taps:   [S, L, C] target taps of every token (zeros past each sequence), target dtype,
               ordinary (not inference-mode) tensors, so they can enter the autograd graph.
    logits: [R, gamma, V] float32 target logits for each draft's token, or None."""

    taps: torch.Tensor
    logits: torch.Tensor | None


def target_features(target: TargetModel, sequences: list[torch.Tensor], layout: BlockLayout,
                    *, with_logits: bool = True) -> TargetBatch:
    """Run the frozen target over ``sequences`` (S tensors [T_s] int64).

    Raises:
        ValueError: the target has no taps configured, or bad token ids (from the target).
    """
    if not target.target_layer_ids:
        raise ValueError("the target was loaded without target_layer_ids: no taps to train on")
    lengths = [int(s.numel()) for s in sequences]
    max_len = max(lengths)
    cache = target.new_kv_cache(len(sequences), max_len)
    slots = torch.tensor([cache.allocate() for _ in sequences], dtype=torch.int64)
    starts = torch.tensor([0] + lengths[:-1], dtype=torch.int64).cumsum(0)
    flat_ids = torch.cat(sequences).to(target.device)
    flat_slots = slots.repeat_interleave(torch.tensor(lengths))
    flat_pos = torch.cat([torch.arange(n) for n in lengths])
    logit_rows = (starts[layout.seq_index][:, None] + layout.target_index).flatten()
    out = target.forward(flat_ids, flat_slots.to(target.device), flat_pos.to(target.device),
                         cache, logit_rows.to(target.device) if with_logits else
                         torch.zeros(1, dtype=torch.int64, device=target.device))
    # clone() outside inference mode turns inference tensors into ordinary ones
    taps = out.taps.new_zeros(len(sequences), max_len, out.taps.shape[1])
    for i, (start, n) in enumerate(zip(starts.tolist(), lengths)):
        taps[i, :n] = out.taps[start:start + n]
    logits = None
    if with_logits:
        logits = out.logits.clone().view(layout.num_blocks, layout.labels.shape[1], -1)
    return TargetBatch(taps=taps.clone(), logits=logits)
