"""Checkpoints: DeepSpec save/load round trip, and both public formats loaded from synthetic
folders written with the documented tensor names (not through our saver)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_serve.drafter import load_drafter, read_config, save_drafter
from dspark_serve.types import SamplingTensors


def _layer_shapes(cfg, bias):
    d, q, kv, dh, ff = (cfg["hidden_size"], cfg["num_attention_heads"] * cfg["head_dim"],
                        cfg["num_key_value_heads"] * cfg["head_dim"], cfg["head_dim"],
                        cfg["intermediate_size"])
    shapes = {"fc.weight": (d, len(cfg["target_layer_ids"]) * d), "hidden_norm.weight": (d,),
              "norm.weight": (d,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, d),
                       p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d),
                       p + "self_attn.o_proj.weight": (d, q),
                       p + "self_attn.q_norm.weight": (dh,), p + "self_attn.k_norm.weight": (dh,),
                       p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                       p + "mlp.down_proj.weight": (d, ff), p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
        if bias:
            shapes.update({p + f"self_attn.{n}_proj.bias": (s,) for n, s in
                           (("q", q), ("k", kv), ("v", kv), ("o", d))})
    return shapes


def _write_folder(path, config, shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = {k: (torch.randn(s, generator=g) * 0.3).to(torch.bfloat16) for k, s in shapes.items()}
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def _target(vocab=61, hidden=32):
    torch.manual_seed(0)
    return (torch.nn.Embedding(vocab, hidden).to(torch.bfloat16),
            torch.nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16))


@pytest.mark.parametrize("overrides", [
    dict(markov_head_type="vanilla"),
    dict(markov_head_type="gated", attention_bias=True),
    dict(markov_head_type="rnn", confidence_head_with_markov=False),
    dict(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip_is_bit_exact(tmp_path, tiny_config, tiny_drafter, overrides, dtype):
    drafter = tiny_drafter(tiny_config(**overrides), seed=4, dtype=dtype)
    save_drafter(drafter, tmp_path / "ckpt")
    loaded = load_drafter(tmp_path / "ckpt", *drafter.shared_modules)
    assert loaded.config == drafter.config
    original, reloaded = drafter.state_dict(), loaded.state_dict()
    assert original.keys() == reloaded.keys()
    for key, tensor in original.items():
        assert reloaded[key].dtype == dtype and torch.equal(reloaded[key], tensor), key
    # Same weights, same draft.
    cache_a, cache_b = drafter.new_cache(1, 8), loaded.new_cache(1, 8)
    taps = torch.randn(4, drafter.config.context_dim).to(dtype)
    args = (torch.tensor([0]), torch.tensor([3]), torch.tensor([4]), SamplingTensors.uniform(1),
            torch.full((1, drafter.gamma), 0.5))
    for model, cache in ((drafter, cache_a), (loaded, cache_b)):
        model.extend_context(cache, torch.zeros(4, dtype=torch.long), torch.arange(4), taps)
    a, b = drafter.draft(cache_a, *args), loaded.draft(cache_b, *args)
    assert torch.equal(a.tokens, b.tokens)
    # float32 GEMMs (MKL) may change the last bits with the weights' memory alignment
    # (measured: 2e-8 on an AMD EPYC host); bfloat16 (oneDNN) is bit-exact.
    atol = 0.0 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(a.probs, b.probs, rtol=0.0, atol=atol)


def test_loads_deepspec_folder_with_documented_names(tmp_path, deepspec_dict):
    config = deepspec_dict(target_layer_ids=[-1, 1, 3], num_target_layers=5)
    shapes = _layer_shapes(config, bias=False)
    shapes.update({"markov_head.markov_w1.weight": (61, 4), "markov_head.markov_w2.weight": (61, 4),
                   "confidence_head.proj.weight": (1, 36), "confidence_head.proj.bias": (1,),
                   # DeepSpec's save_pretrained also writes its frozen copies of these.
                   "embed_tokens.weight": (61, 32), "lm_head.weight": (61, 32)})
    tensors = _write_folder(tmp_path / "ds", config, shapes)
    embed, lm_head = _target()
    drafter = load_drafter(tmp_path / "ds", embed, lm_head)
    assert drafter.gamma == 7 and drafter.config.label_offset == 0
    state = drafter.state_dict()
    assert "embed_tokens.weight" not in state and "backbone.embed_tokens.weight" not in state
    assert torch.equal(state["backbone.layers.1.mlp.down_proj.weight"],
                       tensors["layers.1.mlp.down_proj.weight"])
    assert torch.equal(drafter.markov_head.markov_w2.weight,
                       tensors["markov_head.markov_w2.weight"])
    assert torch.equal(drafter.confidence_head.proj.bias, tensors["confidence_head.proj.bias"])
    assert drafter.shared_modules == (embed, lm_head)
    assert drafter.backbone.fc.weight.dtype == torch.bfloat16
    as_float = load_drafter(tmp_path / "ds", embed, lm_head, dtype=torch.float32)
    assert as_float.backbone.fc.weight.dtype == torch.float32


def test_loads_dflash_folder_with_shifted_labels(tmp_path, dflash_dict, reference_block_hidden):
    """z-lab DFlash: block_size 5 gives gamma 4 draft logits, read from slots 1..4 (the
    anchor's output is unused)."""
    config = dflash_dict(block_size=5, num_target_layers=5,
                         dflash_config={"target_layer_ids": [0, 3], "mask_token_id": 60})
    _write_folder(tmp_path / "zl", config, _layer_shapes(config | {"target_layer_ids": [0, 3]},
                                                         bias=False))
    embed, lm_head = _target()
    drafter = load_drafter(tmp_path / "zl", embed.float(), lm_head.float(), dtype=torch.float32)
    assert drafter.gamma == 4 and drafter.markov_head is None and drafter.confidence_head is None
    taps = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    cache = drafter.new_cache(1, 8)
    drafter.extend_context(cache, torch.zeros(6, dtype=torch.long), torch.arange(6), taps)
    hidden, logits = drafter.block_forward(cache, torch.tensor([0]), torch.tensor([7]),
                                           torch.tensor([6]))
    ref = reference_block_hidden(drafter, taps, 7, 6)
    assert hidden.shape == (1, 4, 32)
    torch.testing.assert_close(hidden[0].double(), ref[1:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="DeepSpec format"):
        save_drafter(drafter, tmp_path / "out")


def test_include_shared_and_sharded_folders(tmp_path, tiny_config, tiny_drafter):
    drafter = tiny_drafter(tiny_config(), seed=2)
    save_drafter(drafter, tmp_path / "full", include_shared=True)
    written = load_file(str(tmp_path / "full" / "model.safetensors"))
    embed, lm_head = drafter.shared_modules
    assert torch.equal(written["embed_tokens.weight"], embed.weight)
    assert torch.equal(written["lm_head.weight"], lm_head.weight)
    assert "markov_head.markov_w1.weight" in written and "fc.weight" in written
    assert not any(k.startswith("backbone.") for k in written)
    reloaded = load_drafter(tmp_path / "full", embed, lm_head)
    assert torch.equal(reloaded.backbone.norm.weight, drafter.backbone.norm.weight)
    # Split the same tensors over two shards with an index, as large HF folders are.
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    keys = sorted(written)
    weight_map = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(keys)}
    for shard in set(weight_map.values()):
        save_file({k: written[k] for k, s in weight_map.items() if s == shard},
                  str(sharded / shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (sharded / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    assert read_config(sharded) == drafter.config
    assert torch.equal(load_drafter(sharded, embed, lm_head).markov_head.markov_w1.weight,
                       drafter.markov_head.markov_w1.weight)


def test_mismatched_folders_raise(tmp_path, tiny_config, tiny_drafter):
    drafter = tiny_drafter(tiny_config())
    save_drafter(drafter, tmp_path / "ok")
    base = load_file(str(tmp_path / "ok" / "model.safetensors"))
    config = (tmp_path / "ok" / "config.json").read_text()
    cases = {
        "missing": {k: v for k, v in base.items() if k != "layers.0.mlp.up_proj.weight"},
        "unexpected": {**base, "layers.0.extra.weight": torch.zeros(2)},
        "wrong shapes": {**base, "norm.weight": torch.zeros(31)},
        "embed_tokens.weight has shape": {**base, "embed_tokens.weight": torch.zeros(60, 32)},
    }
    for message, tensors in cases.items():
        folder = tmp_path / message.replace(" ", "_")
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(config)
        with pytest.raises(ValueError, match=message):
            load_drafter(folder, *drafter.shared_modules)
    (tmp_path / "arch").mkdir()
    (tmp_path / "arch" / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported drafter architectures"):
        read_config(tmp_path / "arch")
