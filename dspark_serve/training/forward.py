"""The drafter's teacher-forced training forward over packed blocks (paper Eq 2-7, Section 3.3).

The context is built with ``DFlashBackbone.context_state`` and ``context_kv`` from the target taps of each whole
sequence (so gradients reach fc, hidden_norm and every layer's k/v projections), gathered per
block and masked to the positions before the block's anchor; ``DFlashBackbone.forward`` runs
the block slots, the target's frozen LM head gives the base logits U_k, and
``block_sampler.teacher_forced`` adds the sequential head's bias B_k on the true prefix and the
confidence logits. This is the same computation as ``DSparkDrafter.draft`` at serving time for
the drafted tokens (``tests/training`` checks it against the inference path).
"""
from __future__ import annotations

import torch

from dspark_serve.drafter.block_sampler import teacher_forced
from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.training.anchors import BlockLayout


def drafter_forward(drafter: DSparkDrafter, taps: torch.Tensor,
                    layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits and confidence logits of R blocks.

    Args:
        drafter: the drafter (its shared embedding and LM head are frozen and not trained).
        taps: [S, L, C] target taps of the S sequences (``TargetBatch.taps``).
        layout: the blocks (``anchors.block_layout``); anchors must be < L.
    Returns:
        logits [R, gamma, V] float32 (U_k + B_k, unwarped), conf_logits [R, gamma] float32
        (zeros without a confidence head).
    Raises:
        ValueError: taps of the wrong width.
    """
    cfg = drafter.config
    s, length, width = taps.shape
    if width != cfg.context_dim:
        raise ValueError(f"taps have width {width}, the drafter expects {cfg.context_dim}")
    # Only positions before the last anchor are ever visible.
    ctx_len = max(int(layout.anchor_positions.max()), 1) if layout.num_blocks else 1
    positions = torch.arange(ctx_len, device=taps.device).repeat(s)
    h_ctx = drafter.backbone.context_state(taps[:, :ctx_len].reshape(s * ctx_len, width))
    k, v = drafter.backbone.context_kv(h_ctx, positions)
    k = k.unflatten(1, (s, ctx_len))
    v = v.unflatten(1, (s, ctx_len))
    embed_tokens, lm_head = drafter.shared_modules
    with torch.no_grad():
        block_embeds = embed_tokens(layout.input_ids)
    if cfg.anchor_context:
        # training anchors are >= 1 (``anchors.anchor_candidates``), so p - 1 is in the context
        block_embeds = drafter.backbone.with_anchor_state(
            block_embeds, h_ctx[layout.seq_index * ctx_len + layout.anchor_positions - 1])
    hidden = drafter.backbone(block_embeds, layout.positions,
                              lambda i: (k[i][layout.seq_index], v[i][layout.seq_index]),
                              layout.context_mask(ctx_len))[:, cfg.label_offset:]
    weight = lm_head.weight
    base_logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight)
    return teacher_forced(base_logits, hidden, layout.input_ids[:, 0], layout.labels,
                          drafter.markov_head, drafter.confidence_head)
