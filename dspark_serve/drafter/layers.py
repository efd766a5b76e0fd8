"""Qwen3-style draft decoder layer with DFlash context injection (paper Eq 3).

Parameter names follow DeepSpec's ``Qwen3DSparkDecoderLayer`` and z-lab's
``Qwen3DFlashDecoderLayer`` (``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``), so
checkpoints load by name. Numerics follow transformers' Qwen3: RMSNorm in float32 then cast
back before the weight, RoPE tables computed in float32 and cast to the activation dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_serve.drafter.config import DSparkConfig


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalised in float32, over the last dim."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled) rotary tables for absolute ``positions``.

    Args:
        positions: int64 of any shape [...].
    Returns:
        cos, sin: [..., head_dim] in ``dtype`` (the two halves repeat, as in Qwen3).
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, H, Dh] by tables cos/sin [..., T, Dh] (shared over heads H)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DraftAttention(nn.Module):
    """Block queries attend to the injected context K/V and, bidirectionally, to the block."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        d, dh = cfg.hidden_size, cfg.head_dim
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, dh
        self.q_proj = nn.Linear(d, hq * dh, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, hkv * dh, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, hkv * dh, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(hq * dh, d, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(dh, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(dh, cfg.rms_norm_eps)

    def keys_values(self, h: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [..., T, Hkv, Dh] of inputs h [..., T, d]; keys normed and rotated."""
        k = self.k_norm(self.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_mask: torch.Tensor) -> torch.Tensor:
        """Args: x [R, G, d] (normed block states), cos/sin [R, G, Dh] at block positions,
        ctx_k/ctx_v [R, L, Hkv, Dh], ctx_mask [R, L] bool (True = visible).
        Returns [R, G, d]."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.keys_values(x, cos, sin)
        k = torch.cat([ctx_k.to(k_blk.dtype), k_blk], dim=1).transpose(1, 2)
        v = torch.cat([ctx_v.to(v_blk.dtype), v_blk], dim=1).transpose(1, 2)
        r, g = x.shape[:2]
        block_visible = torch.ones(r, g, dtype=torch.bool, device=x.device)
        mask = torch.cat([ctx_mask, block_visible], dim=1)[:, None, None, :]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class DraftMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer. The context enters only as extra K/V: it is projected from
    H_ctx directly (no input_layernorm), as in DeepSpec and z-lab."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_mask: torch.Tensor) -> torch.Tensor:
        """Shapes as ``DraftAttention.forward``; returns the new block states [R, G, d]."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, ctx_mask)
        return x + self.mlp(self.post_attention_layernorm(x))
