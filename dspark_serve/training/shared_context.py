"""The drafter's teacher-forced training forward for many blocks of ONE sequence that share
its context (paper Eq 2-7; issue 15's efficient trainer).

``training.forward`` gathers a copy of the context K/V for every block ([R, L, Hkv, Dh] per
layer) and runs SDPA per block. Here the context K/V of the sequence is computed once
([L, Hkv, Dh] per layer) and every block's queries score it with one matmul; the block's own
G keys are scored separately, and one softmax runs over both parts, masked so block r sees
context positions < p_r and its own G slots (bidirectional): the visibility of
``anchors.attention_mask``, i.e. DeepSpec's ``create_dspark_attention_mask``. Anchors are
processed in chunks of ascending position, each scoring only the context prefix its last
anchor can see, so little work is spent on masked-out positions.

The Markov bias of all gamma positions is one gather and one matmul (the vanilla head's bias
W1[x_{k-1}] W2 depends on the previous token only), and the output vocabulary is the draft
vocabulary (``drafter.draft_vocab``: N rows of the target's LM head). U_k + B_k is one
product of [h_k; W1[x_{k-1}]] with [W_v; W2_v], accumulated in float32 inside the matmul (under
bf16 autocast the caller's numerics; the serving path rounds U_k and B_k to bf16 separately
before adding them in float32, a difference of bf16 rounding).

Shape symbols: A anchors (blocks), G block slots, gamma draft positions, L context positions,
d hidden, N draft vocabulary, C tap width.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dspark_serve.drafter.layers import DraftAttention, DraftLayer, apply_rope, rope_cos_sin
from dspark_serve.drafter.markov_head import MarkovHead
from dspark_serve.drafter.model import DSparkDrafter


def _attention(attn: DraftAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               ctx_k: torch.Tensor, ctx_v: torch.Tensor, anchors: torch.Tensor,
               chunk: int) -> torch.Tensor:
    """Block attention against a shared context. x [A, G, d], cos/sin [A, G, Dh],
    ctx_k/ctx_v [L, Hkv, Dh], anchors [A] int64 ascending. Returns [A, G, d]."""
    a, g, _ = x.shape
    hq, hkv, dh = attn.num_heads, attn.num_kv_heads, attn.head_dim
    grp = hq // hkv
    q = apply_rope(attn.q_norm(attn.q_proj(x).unflatten(-1, (hq, dh))), cos, sin)
    k_blk, v_blk = attn.keys_values(x, cos, sin)                       # [A, G, Hkv, Dh]
    # query rows grouped by kv head: [A, Hkv, grp * G, Dh]
    q = q.view(a, g, hkv, grp, dh).permute(0, 2, 3, 1, 4).reshape(a, hkv, grp * g, dh)
    q = q * (1.0 / math.sqrt(dh))
    k_blk, v_blk = k_blk.transpose(1, 2), v_blk.transpose(1, 2)          # [A, Hkv, G, Dh]
    ctx_k, ctx_v = ctx_k.transpose(0, 1), ctx_v.transpose(0, 1)          # [Hkv, L, Dh]
    outs = []
    for start in range(0, a, chunk):
        sl = slice(start, start + chunk)
        qc, pos = q[sl], anchors[sl]
        length = int(pos[-1])
        n = qc.shape[0]
        # [Hkv, n * grp * G, Dh] @ [Hkv, Dh, length]: every block against the shared prefix
        s_ctx = torch.matmul(qc.transpose(0, 1).reshape(hkv, n * grp * g, dh),
                             ctx_k[:, :length].transpose(1, 2).to(qc.dtype))
        s_ctx = s_ctx.view(hkv, n, grp * g, length).transpose(0, 1)     # [n, Hkv, grp*G, len]
        hidden = torch.arange(length, device=x.device) >= pos[:, None]   # [n, len]
        s_ctx = s_ctx.masked_fill(hidden[:, None, None, :], float("-inf"))
        s_blk = torch.matmul(qc, k_blk[sl].transpose(-1, -2))            # [n, Hkv, grp*G, G]
        probs = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(qc.dtype)
        p_ctx, p_blk = probs.split([length, g], dim=-1)
        o = torch.matmul(p_ctx.transpose(0, 1).reshape(hkv, n * grp * g, length),
                         ctx_v[:, :length].to(qc.dtype)).view(hkv, n, grp * g, dh).transpose(0, 1)
        o = o + torch.matmul(p_blk, v_blk[sl])
        outs.append(o)
    o = torch.cat(outs).view(a, hkv, grp, g, dh).permute(0, 3, 1, 2, 4).reshape(a, g, hq * dh)
    return attn.o_proj(o)


def _layer(layer: DraftLayer, x, cos, sin, ctx_k, ctx_v, anchors, chunk) -> torch.Tensor:
    x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, ctx_k, ctx_v,
                       anchors, chunk)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def shared_context_forward(drafter: DSparkDrafter, taps: torch.Tensor, ids: torch.Tensor,
                           anchors: torch.Tensor, *, tap_scale: torch.Tensor | None = None,
                           chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backbone hidden states, draft-space logits (Eq 4: U_k + B_k) and confidence logits
    (Eq 7) of the blocks anchored at ``anchors`` in one sequence, teacher-forced on the
    sequence's own tokens.

    Args:
        drafter: the drafter; its LM head (``shared_modules[1]``) must be a module with a
            ``weight`` [N, d] (the pruned head, or the target's head for N = V).
        taps: [T, C] target taps of the sequence (any float dtype).
        ids: [T] int64 tokens of the sequence.
        anchors: [A] int64 strictly increasing positions in [1, T - 2] (a block sees the
            context before its anchor, so p >= 1; its first label p + 1 must exist).
        tap_scale: optional [C] float multiplier applied to the taps before ``fc`` (tap
            normalisation; ``fold_tap_scale`` folds it into fc for saving).
        chunk: anchors scored against the context per matmul.
    Returns:
        logits [A, gamma, N] float32, conf_logits [A, gamma] float32 (zeros without a head),
        prev [A, gamma] int64 (x_{k-1}: anchor, then the sequence's next gamma - 1 tokens,
        0 past its end).
    Raises:
        ValueError: bad anchors or shapes, or a sequential head other than vanilla Markov.
    """
    cfg = drafter.config
    t = ids.numel()
    if taps.shape != (t, cfg.context_dim):
        raise ValueError(f"taps must be [{t}, {cfg.context_dim}], got {tuple(taps.shape)}")
    a = anchors.numel()
    if a == 0 or anchors.dtype != torch.int64 or int(anchors[0]) < 1 or \
            int(anchors[-1]) > t - 2 or (a > 1 and not bool((anchors[1:] > anchors[:-1]).all())):
        raise ValueError(f"anchors must be int64, strictly increasing, in [1, {t - 2}]")
    head = drafter.markov_head
    if head is not None and type(head) is not MarkovHead:
        raise ValueError("the shared-context forward supports the vanilla Markov head only")
    backbone = drafter.backbone
    length = int(anchors[-1])
    ctx_in = taps[:length] if tap_scale is None else taps[:length].float() * tap_scale
    h_ctx = backbone.context_state(ctx_in)
    ctx_cos, ctx_sin = rope_cos_sin(torch.arange(length, device=ids.device), cfg.head_dim,
                                    cfg.rope_theta, backbone.dtype)
    offsets = torch.arange(cfg.block_size, device=ids.device)
    positions = anchors[:, None] + offsets                                # [A, G]
    embed_tokens, lm_head = drafter.shared_modules
    block_ids = torch.where(offsets == 0, ids[anchors][:, None], cfg.mask_token_id)
    with torch.no_grad():
        x = embed_tokens(block_ids)
    x = x.to(backbone.dtype)
    if cfg.anchor_context:
        x = backbone.with_anchor_state(x, h_ctx[anchors - 1])
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, backbone.dtype)
    for layer in backbone.layers:
        ctx_k, ctx_v = layer.self_attn.keys_values(h_ctx, ctx_cos, ctx_sin)
        x = _layer(layer, x, cos, sin, ctx_k, ctx_v, anchors, chunk)
    hidden = backbone.norm(x)[:, cfg.label_offset:]                        # [A, gamma, d]
    gamma = cfg.gamma
    prev_pos = anchors[:, None] + torch.arange(gamma, device=ids.device)
    # past the sequence end (masked labels) token 0, as ``anchors.block_layout`` labels it
    prev = torch.where(prev_pos < t, ids[prev_pos.clamp(max=t - 1)], 0)
    weight = lm_head.weight
    markov = None
    if head is None:
        logits = F.linear(hidden.to(weight.dtype), weight).float()
    else:
        # U_k + B_k = [h_k; W1[x_{k-1}]] . [W_v; W2_v]: one product over the draft vocabulary
        markov = head.prev_embedding(prev)
        w2 = head.markov_w2.weight.to(weight.dtype)
        logits = F.linear(torch.cat([hidden, markov], dim=-1).to(weight.dtype),
                          torch.cat([weight, w2], dim=1)).float()
    conf = torch.zeros(a, gamma, device=ids.device)
    if drafter.confidence_head is not None:
        conf = drafter.confidence_head(hidden, markov if drafter.confidence_head.markov_rank
                                       else None)
    return logits, conf, prev


def fold_tap_scale(drafter: DSparkDrafter, tap_scale: torch.Tensor) -> None:
    """fc(x * s) = (fc.weight * s) x: fold a tap scale [C] into fc's columns in place, so the
    saved drafter needs no normalisation at serving time."""
    with torch.no_grad():
        w = drafter.backbone.fc.weight
        w.copy_((w.float() * tap_scale.to(w.device)).to(w.dtype))
