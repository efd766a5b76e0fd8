"""DFlash parallel backbone (paper Eq 2-3): one forward pass over a whole draft block.

Context (Eq 2): the target's hidden taps of committed tokens, concatenated in
``target_layer_ids`` order ([N, m*d]; tap -1 is the embedding output, tap l the output of
target layer l, i.e. transformers' ``hidden_states[l + 1]``), become
H_ctx = hidden_norm(fc(taps)). Injection (Eq 3): every draft layer i projects H_ctx with its
own k_proj/v_proj (k_norm and RoPE at the tokens' absolute positions) and puts those keys and
values in front of the block's. Block: slot j sits at position anchor_pos + j; it sees every
block slot (bidirectional) and the context positions < anchor_pos, exactly the visibility of
DeepSpec's training mask (``create_dspark_attention_mask``: kv < anchor_pos, or same block)
and of its evaluator (draft cache cropped back to the anchor position each round).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dspark_serve.drafter.config import DSparkConfig
from dspark_serve.drafter.layers import DraftLayer, RMSNorm, rope_cos_sin

# (layer index) -> (ctx_k, ctx_v), each [R, L, Hkv, Dh]; lets callers gather one layer's
# context at a time instead of materialising all layers at once.
ContextKV = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class DFlashBackbone(nn.Module):
    """fc, hidden_norm, the draft layers and the final norm (DeepSpec/z-lab tensor names)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.context_dim, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context_state(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """H_ctx = hidden_norm(fc(taps)) of N committed tokens (Eq 2).

        Args:
            target_hidden: [N, len(target_layer_ids) * hidden_size] float, target taps.
        Returns:
            [N, hidden_size] in the backbone dtype.
        Raises:
            ValueError: taps of the wrong shape.
        """
        if target_hidden.dim() != 2 or target_hidden.shape[1] != self.cfg.context_dim:
            raise ValueError(f"target_hidden must be [N, {self.cfg.context_dim}], got "
                             f"{tuple(target_hidden.shape)}")
        return self.hidden_norm(self.fc(target_hidden.to(self.dtype)))

    def context_kv(self, h_ctx: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context keys/values of every layer for N committed tokens (Eq 3).

        Args:
            h_ctx: [N, hidden_size] context states (``context_state``).
            positions: [N] int64 absolute positions of those tokens.
        Returns:
            k, v: [num_layers, N, Hkv, Dh] in the backbone dtype.
        Raises:
            ValueError: wrong shapes.
        """
        n = positions.shape[0]
        if h_ctx.shape != (n, self.cfg.hidden_size) or positions.dim() != 1:
            raise ValueError(f"h_ctx must be [{n}, {self.cfg.hidden_size}] for positions [N], "
                             f"got {tuple(h_ctx.shape)} and {tuple(positions.shape)}")
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, self.dtype)
        kv = [layer.self_attn.keys_values(h_ctx, cos, sin) for layer in self.layers]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    @staticmethod
    def with_anchor_state(block_embeds: torch.Tensor, anchor_state: torch.Tensor) -> torch.Tensor:
        """Block inputs of an ``anchor_context`` drafter: slot 0 (the anchor) gets
        embed(anchor) + H_ctx[p - 1]. block_embeds [R, G, d], anchor_state [R, d]; returns
        [R, G, d] in block_embeds' dtype."""
        first = block_embeds[:, :1] + anchor_state[:, None].to(block_embeds.dtype)
        return torch.cat([first, block_embeds[:, 1:]], dim=1)

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                context: ContextKV, ctx_mask: torch.Tensor) -> torch.Tensor:
        """Hidden states of R blocks after the final norm.

        Args:
            block_embeds: [R, G, d] embeddings of the block slots (anchor, then mask tokens).
            block_positions: [R, G] int64 absolute positions of the slots.
            context: layer index -> (ctx_k, ctx_v) [R, L, Hkv, Dh] (from ``context_kv``).
            ctx_mask: [R, L] bool, True where a context position is visible to the block.
        Returns:
            [R, G, d] in the backbone dtype.
        """
        x = block_embeds.to(self.dtype)
        cos, sin = rope_cos_sin(block_positions, self.cfg.head_dim, self.cfg.rope_theta,
                                self.dtype)
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v = context(i)
            x = layer(x, cos, sin, ctx_k, ctx_v, ctx_mask)
        return self.norm(x)
