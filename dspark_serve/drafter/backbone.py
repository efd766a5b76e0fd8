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
from dspark_serve.drafter.context_cache import DraftContextCache
from dspark_serve.drafter.layers import DraftLayer, RMSNorm, rope_cos_sin
from dspark_serve.ops.quantized_linear import QuantizedWeight, cpu_kernel, quantize_weight

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
        # (kernel module, per-layer quantized weights, context weights or None, RoPE inverse
        # frequencies [Dh / 2]) once ``compile_layers`` succeeded
        self._compiled: tuple[object, list[dict], dict | None, torch.Tensor] | None = None

    @property
    def compiled(self) -> bool:
        """Whether ``compiled_forward`` is set up (``compile_layers``)."""
        return self._compiled is not None

    def compile_layers(self, bits: int = 8) -> bool:
        """Run the draft layers as one compiled call each (``ops.cpu`` ``draft_layer``) and the
        context projection as one more (``draft_context``: fc, hidden_norm and every layer's
        context keys and values), with ``bits``-bit (4 or 8) copies of the projections (q/k/v,
        k/v and gate/up fused), for inference on a CPU with the quantized-linear kernel (the
        drafter of an int4 target: ``build_drafter``).
        The modules keep their parameters; later changes to them are not seen. Returns False
        (nothing changes) without the kernel, off the CPU, or for shapes it does not take
        (head_dim 64 or 128, at most 16 query heads per KV head, bfloat16 weights)."""
        cfg, kernel = self.cfg, cpu_kernel()
        if (kernel is None or self.fc.weight.device.type != "cpu" or self.dtype != torch.bfloat16
                or cfg.head_dim not in (64, 128) or cfg.hidden_size % 32 or cfg.context_dim % 32
                or cfg.intermediate_size % 32
                or cfg.num_attention_heads // cfg.num_key_value_heads > 16):
            return False

        def quantized(*linears: nn.Linear) -> tuple:
            weight = torch.cat([lin.weight.detach() for lin in linears])
            return quantize_weight(weight, bits).kernel_args

        def bias(*linears: nn.Linear) -> torch.Tensor | None:
            if linears[0].bias is None:
                return None
            return torch.cat([lin.bias.detach() for lin in linears]).to(torch.bfloat16)

        context = dict(fc=quantized(self.fc),
                       hidden_norm=self.hidden_norm.weight.detach().contiguous(),
                       kv=[quantized(layer.self_attn.k_proj, layer.self_attn.v_proj)
                           for layer in self.layers],
                       k_norms=[layer.self_attn.k_norm.weight.detach().contiguous()
                                for layer in self.layers])
        layers = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(dict(
                input_norm=layer.input_layernorm.weight.detach().contiguous(),
                post_norm=layer.post_attention_layernorm.weight.detach().contiguous(),
                qkv=quantized(attn.q_proj, attn.k_proj, attn.v_proj),
                qkv_bias=bias(attn.q_proj, attn.k_proj, attn.v_proj),
                o_proj=quantized(attn.o_proj), o_bias=bias(attn.o_proj),
                gate_up=quantized(mlp.gate_proj, mlp.up_proj), down=quantized(mlp.down_proj),
                q_norm=attn.q_norm.weight.detach().contiguous(),
                k_norm=attn.k_norm.weight.detach().contiguous()))
        if cfg.attention_bias:   # the context kernel takes no biases
            context = None
        exponents = torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** exponents)     # as rope_cos_sin computes it
        self._compiled = (kernel, layers, context, inv_freq)
        return True

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

    def compiled_context(self, target_hidden: torch.Tensor, positions: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``context_state`` and ``context_kv`` in one compiled call (``compile_layers``;
        quantized projections, float32 inside): (h_ctx [N, d], k, v [num_layers, N, Hkv, Dh]),
        bfloat16; None when not compiled (or the layers have biases).

        Raises:
            ValueError: taps of the wrong shape.
        """
        if self._compiled is None or self._compiled[2] is None:
            return None
        if target_hidden.dim() != 2 or target_hidden.shape[1] != self.cfg.context_dim \
                or positions.shape != target_hidden.shape[:1]:
            raise ValueError(f"target_hidden must be [N, {self.cfg.context_dim}] for positions "
                             f"[N], got {tuple(target_hidden.shape)} and "
                             f"{tuple(positions.shape)}")
        kernel, _, w, _ = self._compiled
        cos, sin = self._rope_factors(positions)
        return kernel.draft_context(target_hidden.to(torch.bfloat16).contiguous(), w["fc"],
                                    w["hidden_norm"], w["kv"], w["k_norms"], cos, sin,
                                    self.cfg.rms_norm_eps, self.cfg.num_key_value_heads)

    def _rope_factors(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, Dh / 2] float32 of positions [N] (the compiled layers' RoPE tables)."""
        angles = positions.reshape(-1, 1).float() * self._compiled[3]
        return angles.cos(), angles.sin()

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

    def compiled_forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                         cache: DraftContextCache, slots: torch.Tensor,
                         ctx_lens: torch.Tensor) -> torch.Tensor:
        """``forward`` through the compiled layers (``compile_layers``), reading the context
        K/V straight from the cache's pages: block r sees the first ctx_lens[r] context
        positions of slot slots[r] and its own block. Same numbers as ``forward`` up to the
        quantized projections and float32 (not bfloat16) arithmetic inside a layer.

        Args:
            block_embeds: [R, G, d]; block_positions: [R, G] int64.
            cache: the drafter's context cache; slots, ctx_lens: [R] int64.
        Returns:
            [R, G, d] bfloat16 after the final norm.
        Raises:
            RuntimeError: not compiled, or bad shapes / slots / lengths (from the kernel).
        """
        if self._compiled is None:
            raise RuntimeError("compiled_forward needs compile_layers() first")
        kernel, layers = self._compiled[:2]
        cfg = self.cfg
        r, g, d = block_embeds.shape
        cos, sin = self._rope_factors(block_positions.reshape(-1))
        x = block_embeds.reshape(r * g, d).to(torch.bfloat16).contiguous()
        table = cache.page_table.contiguous()
        slots, ctx_lens = slots.contiguous(), ctx_lens.contiguous()
        for i, w in enumerate(layers):
            x = kernel.draft_layer(x, w["input_norm"], w["post_norm"], cfg.rms_norm_eps, w["qkv"],
                         w["qkv_bias"], w["o_proj"], w["o_bias"], w["gate_up"], w["down"],
                         w["q_norm"], w["k_norm"], cos, sin, cache.k[i], cache.v[i], table,
                         slots, ctx_lens, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.head_dim ** -0.5)
        return self.norm(x.view(r, g, d))
