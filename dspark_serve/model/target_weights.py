"""Target weights taken out of a transformers Llama / Qwen2 / Qwen3 causal LM, laid out for
``TargetModel.forward``: q/k/v and gate/up projections fused into one matrix each (one matmul
instead of three or two; ``Linear`` prepacks them for oneDNN in bfloat16 on CPU), Qwen3's q_norm/k_norm weights stacked per head so both norms are one
call, and the RoPE inverse frequencies of the config (any ``rope_type`` whose frequencies do
not depend on the sequence length: default, linear, llama3, yarn, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_serve.model.linear import Int4Linear, Linear, QuantizedLinear, make_head, make_linear
from dspark_serve.ops.huge_pages import on_huge_pages

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# Their inverse frequencies are rescaled with the running sequence length, so one position
# would not map to one rotation; unsupported rather than silently different.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass
class LayerWeights:
    """One decoder layer; shapes with H hidden, D head_dim, I intermediate size.

    qkv: H -> (Hq + 2 Hkv) D, q then k then v heads (bias: Qwen2).
    qk_norm: [Hq + Hkv, D] q_norm rows then k_norm rows (Qwen3), or None.
    o_proj: Hq D -> H; gate_up: H -> 2 I (gate, then up); down: I -> H.
    input_norm, post_norm: [H] RMSNorm weights.
    """

    input_norm: torch.Tensor
    qkv: Linear | Int4Linear | QuantizedLinear
    qk_norm: torch.Tensor | None
    o_proj: Linear | Int4Linear | QuantizedLinear
    post_norm: torch.Tensor
    gate_up: Linear | Int4Linear | QuantizedLinear
    down: Linear | Int4Linear | QuantizedLinear


@dataclass
class TargetWeights:
    """All weights plus the sizes the forward needs.

    embed: [V, H]; lm_head: [V, H] plain weight (the same tensor as embed when tied), for
    sharing with the drafter; head: the same projection as a (possibly packed) ``Linear``;
    final_norm: [H]; inv_freq: [D / 2] float32; rope_scale: RoPE attention factor (yarn).
    """

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    head: Linear | QuantizedLinear
    inv_freq: torch.Tensor
    rope_scale: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.embed.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, D] in the model dtype for ``positions`` [T] int64, such
        that ``x * cos + x.roll(D // 2, -1) * sin`` equals transformers'
        ``x * cos + rotate_half(x) * sin`` (angles computed in float32 like transformers)."""
        cos, sin = self.rope_angles(positions)
        sin = torch.cat((-sin, sin), dim=-1)
        return cos.repeat(1, 2)[:, None].to(self.embed.dtype), sin[:, None].to(self.embed.dtype)

    def rope_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D / 2] float32 of the rotation angles of ``positions`` [T] int64, times
        the RoPE attention factor."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq
        return freqs.cos() * self.rope_scale, freqs.sin() * self.rope_scale


def _check_supported(config) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported target model_type {config.model_type!r}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"only SwiGLU (hidden_act='silu') targets are supported, got "
                         f"{config.hidden_act!r}")
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError("sliding-window attention layers are not supported")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"rope_type {rope['rope_type']!r} is not supported (its frequencies "
                         "depend on the sequence length)")


def _cat(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    if all(t is None for t in tensors):
        return None
    if any(t is None for t in tensors):
        raise ValueError("fused projections must all have a bias or none")
    return torch.cat(tensors, dim=0).contiguous()


def _stream_from_huge_pages(linears: list) -> None:
    """Move the CPU kernel's quantized weights (``QuantizedLinear``, the ones a decode step
    streams whole) into one buffer on transparent huge pages (``ops.huge_pages``; measured on
    a 2-core Sapphire Rapids VM: see README, "Speed on a CPU"). Values unchanged."""
    weights = [p.quantized for p in linears
               if isinstance(p, QuantizedLinear) and p.quantized.packed.device.type == "cpu"]
    moved = iter(on_huge_pages([t for w in weights for t in (w.packed, w.scales)]))
    for w in weights:
        w.packed, w.scales = next(moved), next(moved)


def load_weights(hf_model, device: torch.device | str | None = None,
                 quantization: str = "none") -> TargetWeights:
    """Copy the weights of a transformers ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
    ``Qwen3ForCausalLM`` (in its dtype) onto ``device`` (None = where they are); with
    ``quantization="int4"`` the decoder layers' projections become 4-bit (``make_linear``:
    our ``QuantizedLinear`` where its kernel runs, torch's ``Int4Linear`` elsewhere) and,
    with our kernel, the LM head 8-bit (``make_head``). The embedding and norms stay in the
    model dtype, the head never goes below 8 bits: GGUF files keep those at higher precision
    too (the default model's embedding, tied to its head, is Q8_0), and 4-bit logits would
    move every token's distribution.

    Raises:
        ValueError: unsupported architecture or features (see module docstring), or weights
            the quantization cannot take.
    """
    config = hf_model.config
    _check_supported(config)
    dev = hf_model.device if device is None else torch.device(device)

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().to(dev).contiguous()

    def linear(weight: torch.Tensor, bias: torch.Tensor | None):
        return make_linear(take(weight), take(bias), quantization)

    layers = []
    for layer in hf_model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qk_norm = None
        if hasattr(attn, "q_norm"):
            qk_norm = torch.cat((attn.q_norm.weight.expand(config.num_attention_heads, -1),
                                 attn.k_norm.weight.expand(config.num_key_value_heads, -1)))
        layers.append(LayerWeights(
            input_norm=take(layer.input_layernorm.weight),
            qkv=linear(_cat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                       _cat(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)),
            qk_norm=take(qk_norm),
            o_proj=linear(attn.o_proj.weight, attn.o_proj.bias),
            post_norm=take(layer.post_attention_layernorm.weight),
            gate_up=linear(_cat(mlp.gate_proj.weight, mlp.up_proj.weight),
                           _cat(mlp.gate_proj.bias, mlp.up_proj.bias)),
            down=linear(mlp.down_proj.weight, mlp.down_proj.bias)))
    embed = take(hf_model.model.embed_tokens.weight)
    head = hf_model.lm_head.weight
    lm_head = embed if head is hf_model.model.embed_tokens.weight else take(head)
    rotary = hf_model.model.rotary_emb
    attn0 = hf_model.model.layers[0].self_attn
    head = make_head(lm_head, quantization)
    _stream_from_huge_pages([head] + [p for layer in layers for p in (
        layer.qkv, layer.o_proj, layer.gate_up, layer.down)])
    return TargetWeights(
        embed=embed, layers=layers, final_norm=take(hf_model.model.norm.weight), lm_head=lm_head,
        head=head,
        inv_freq=rotary.inv_freq.detach().to(dev, torch.float32),
        rope_scale=float(rotary.attention_scaling),
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=attn0.head_dim, eps=float(config.rms_norm_eps), scale=float(attn0.scaling))
