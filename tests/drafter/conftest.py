"""Tiny drafters with seeded random weights, tiny DeepSpec/DFlash config.json objects, and an
explicit float64 reference of the block forward (written from the paper's Eq 2-3 and
DeepSpec's training mask, independent of the model code: plain matmuls, an explicit boolean
visibility matrix and a softmax)."""
import math

import pytest
import torch

from dspark_serve.drafter import DSparkConfig, DSparkDrafter

VOCAB, HIDDEN, MASK_ID = 61, 32, 60


def tiny_config(**overrides) -> DSparkConfig:
    values = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=VOCAB,
                  block_size=5, mask_token_id=MASK_ID, target_layer_ids=[-1, 1, 3],
                  num_target_layers=5, rope_theta=10000.0, markov_rank=6,
                  markov_head_type="vanilla", enable_confidence_head=True,
                  confidence_head_with_markov=True)
    values.update(overrides)
    return DSparkConfig(**values)


def tiny_drafter(cfg: DSparkConfig, seed: int = 0, dtype=torch.float32) -> DSparkDrafter:
    """Random weights large enough that every part of the network moves the output; norm
    weights around 1 so a missing norm is visible."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    drafter = DSparkDrafter(cfg, embed, lm_head)
    with torch.no_grad():
        for module in (embed, lm_head, drafter):
            for name, p in module.named_parameters():
                noise = torch.randn(p.shape, generator=g) * 0.3
                p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    embed.to(dtype), lm_head.to(dtype)
    return drafter.to(dtype)


def deepspec_dict(**overrides):
    """A DeepSpec DSpark config.json (transformers 5 layout, as build_draft_config writes it
    for a Qwen3 target), shrunk to tiny sizes."""
    cfg = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "dtype": "bfloat16",
        "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "hidden_size": 32, "intermediate_size": 48, "head_dim": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 61,
        "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False,
        "block_size": 7, "mask_token_id": 60, "target_layer_ids": [1, 9, 17, 25, 33],
        "num_target_layers": 36, "num_anchors": 512, "markov_rank": 4,
        "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }
    cfg.update(overrides)
    return cfg


def dflash_dict(**overrides):
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 32,
        "intermediate_size": 48, "head_dim": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 61,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "block_size": 16, "num_target_layers": 36,
        "dflash_config": {"target_layer_ids": [1, 17, 33], "mask_token_id": 60},
    }
    cfg.update(overrides)
    return cfg


@pytest.fixture(name="deepspec_dict")
def deepspec_dict_fixture():
    return deepspec_dict


@pytest.fixture(name="dflash_dict")
def dflash_dict_fixture():
    return dflash_dict


@pytest.fixture(name="tiny_config")
def tiny_config_fixture():
    return tiny_config


@pytest.fixture(name="tiny_drafter")
def tiny_drafter_fixture():
    return tiny_drafter


def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta):
    """x [T, H, D], pos [T]: rotate the pairs (i, i + D/2) by pos * theta^(-2i/D)."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    ang = pos.double()[:, None, None] * freq
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


def reference_block_hidden(drafter: DSparkDrafter, taps: torch.Tensor, anchor: int,
                           anchor_pos: int, causal_block: bool = False) -> torch.Tensor:
    """Final-norm hidden states [block_size, d] (float64) of one block.

    taps [L, C]: target taps of context positions 0..L-1 (L may exceed anchor_pos: those
    positions must stay invisible). The block (anchor, then mask tokens) sits at
    anchor_pos + j. Visibility: context position p iff p < anchor_pos; every block slot
    (bidirectional), or only earlier slots with ``causal_block`` (a negative control).
    """
    cfg = drafter.config
    w = {k: v.double() for k, v in drafter.state_dict().items()}
    embed, _ = drafter.shared_modules
    eps, dh = cfg.rms_norm_eps, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    ctx_len, blk = taps.shape[0], cfg.block_size
    h_ctx = _rms(taps.double() @ w["backbone.fc.weight"].T, w["backbone.hidden_norm.weight"], eps)
    ids = torch.tensor([anchor] + [cfg.mask_token_id] * (blk - 1))
    x = embed.weight.double()[ids]
    pos = torch.cat([torch.arange(ctx_len), anchor_pos + torch.arange(blk)])
    visible = torch.zeros(blk, ctx_len + blk, dtype=torch.bool)
    visible[:, :ctx_len] = torch.arange(ctx_len) < anchor_pos
    visible[:, ctx_len:] = (torch.tril(torch.ones(blk, blk)) if causal_block
                            else torch.ones(blk, blk)).bool()
    for i in range(cfg.num_hidden_layers):
        p = f"backbone.layers.{i}."
        xn = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rms((xn @ w[p + "self_attn.q_proj.weight"].T).view(blk, hq, dh),
                 w[p + "self_attn.q_norm.weight"], eps)
        src = torch.cat([h_ctx, xn])
        k = _rms((src @ w[p + "self_attn.k_proj.weight"].T).view(-1, hkv, dh),
                 w[p + "self_attn.k_norm.weight"], eps)
        v = (src @ w[p + "self_attn.v_proj.weight"].T).view(-1, hkv, dh)
        q, k = _rope(q, pos[ctx_len:], cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
        heads = []
        for h in range(hq):
            kv = h // (hq // hkv)
            scores = q[:, h] @ k[:, kv].T / math.sqrt(dh)
            scores = scores.masked_fill(~visible, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v[:, kv])
        x = x + torch.cat(heads, -1) @ w[p + "self_attn.o_proj.weight"].T
        xn = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = xn @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * (xn @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["backbone.norm.weight"], eps)


@pytest.fixture(name="reference_block_hidden")
def reference_block_hidden_fixture():
    return reference_block_hidden
