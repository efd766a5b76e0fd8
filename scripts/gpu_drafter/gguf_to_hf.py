"""Dequantize the default target's GGUF file into the HF folder ``default_model._convert``
makes, without transformers' GGUF loader (numpy only, through ``gguf``): the GPU training job
(``run.sh``) runs where only the GGUF bytes travel. Bit-equal to the transformers conversion
(checked against the cached folder before every device run: ``--check``).

    python scripts/gpu_drafter/gguf_to_hf.py GGUF CONFIG_DIR OUT_DIR [--check HF_DIR]
"""
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "ffn_down": "mlp.down_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp stores q/k rows interleaved for its RoPE; HF keeps halves
    rows = w.shape[0] // heads // 2
    return w.reshape(heads, rows, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(gguf_path: str, config_dir: str, out_dir: str) -> dict:
    import json
    cfg = json.loads((Path(config_dir) / "config.json").read_text())
    state = {}
    for t in GGUFReader(gguf_path).tensors:
        w = dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])
        w = w.astype(np.float32)
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        else:
            _, layer, kind, _ = t.name.split(".")
            name = f"model.layers.{layer}.{_NAMES[kind]}.weight"
            if kind == "attn_q":
                w = _unpermute(w, cfg["num_attention_heads"])
            elif kind == "attn_k":
                w = _unpermute(w, cfg["num_key_value_heads"])
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(config_dir).iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return state


if __name__ == "__main__":
    state = convert(*sys.argv[1:4])
    if len(sys.argv) > 5 and sys.argv[4] == "--check":
        ref = load_file(str(Path(sys.argv[5]) / "model.safetensors"))
        assert ref.keys() == state.keys(), sorted(set(ref) ^ set(state))
        bad = [k for k in ref if not torch.equal(ref[k], state[k])]
        assert not bad, bad[:5]
        print(f"gguf_to_hf: {len(ref)} tensors bit-equal to {sys.argv[5]}")
