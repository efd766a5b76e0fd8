"""The int4 fast path: decoder layers as one compiled call each (``TargetModel._fused``), on
tiny random models whose shapes it takes (head_dim 64), against the Python layer loop over the
same quantized projections and against transformers in float32."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from dspark_serve.model.linear import QuantizedLinear
from dspark_serve.model.target_model import TargetModel
from dspark_serve.ops.quantized_linear import cpu_kernel
from tests.model.test_target_model import (assert_logits_do_not_depend_on_batching, hf_logits,
                                           page_layout_runs)

pytestmark = pytest.mark.skipif(
    cpu_kernel() is None, reason="no AVX512-VNNI or AVX2 CPU, or no C++ toolchain for the kernel")

FUSABLE = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=1024)


def tiny(config_cls, seed=0, **extra):
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config_cls(**FUSABLE, **extra)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.3 * torch.randn_like(p))
    return hf


def int4_pair(hf):
    """(fused model, the same weights through the Python layer loop)."""
    fused = TargetModel.from_hf(hf.to(torch.bfloat16), quantization="int4")
    loop = TargetModel(fused.weights, fused.config)
    loop._fused = None
    return fused, loop


@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config])
def test_fused_layers_match_the_python_loop(config_cls):
    """Same projections, float32 norms / RoPE / attention in between instead of bfloat16: the
    fused logits are as close to transformers' float32 logits as the loop's (Qwen2: q/k/v
    biases included)."""
    hf = tiny(config_cls)
    reference = [hf_logits(hf, seq) for seq in ([5, 17, 3, 88, 40, 1, 2], list(range(30, 90)))]
    fused, loop = int4_pair(hf)
    assert fused._fused is not None and isinstance(fused.weights.head, QuantizedLinear)
    if config_cls is Qwen2Config:
        assert fused.weights.layers[0].qkv.bias is not None
    for ref, seq in zip(reference, ([5, 17, 3, 88, 40, 1, 2], list(range(30, 90)))):
        errors = {}
        for name, model in (("fused", fused), ("loop", loop)):
            cache = model.new_kv_cache(1, 128)
            slot = cache.allocate()
            n = len(seq)
            logits = model.forward(torch.tensor(seq), torch.full((n,), slot), torch.arange(n),
                                   cache).logits
            errors[name] = float((logits - ref).abs().mean())
        assert errors["fused"] <= 1.2 * errors["loop"] + 0.01, errors


def test_fused_logits_do_not_depend_on_batching():
    """Decoded alone, chunk-prefilled next to other requests' decode tokens, or verified inside
    one block, a token's logits keep their bits: greedy speculative decoding on the int4
    target reproduces its plain decoding."""
    fused, _ = int4_pair(tiny(LlamaConfig, seed=1))
    assert_logits_do_not_depend_on_batching(fused)


def test_fused_logits_do_not_depend_on_the_page_layout():
    """Interleaved pages of a pool (the kernel walks each slot's page table) give the logits
    of one page per slot, bit for bit."""
    fused, _ = int4_pair(tiny(LlamaConfig, seed=2))
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (300,), generator=gen) for _ in range(2)]
    contiguous, paged, pages = page_layout_runs(fused, seqs)
    assert pages == [[0, 2, 4, 5, 6], [1, 3, 7, 8, 9]]
    assert torch.equal(paged, contiguous)
    # any int64 index tensors, e.g. an expanded slot (stride 0)
    logits = []
    for slots in (lambda s: torch.tensor(s).expand(300), lambda s: torch.full((300,), s)):
        cache = fused.new_kv_cache(1, 320)
        logits.append(fused.forward(seqs[0], slots(cache.allocate(300)), torch.arange(300),
                                    cache).logits)
    assert torch.equal(*logits)


def test_models_the_fused_layer_cannot_take_use_the_loop():
    """head_dim 32 (not 64 / 128): int4 projections, Python loop."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**FUSABLE, "head_dim": 32})
    model = TargetModel.from_hf(AutoModelForCausalLM.from_config(config).eval()
                                .to(torch.bfloat16), quantization="int4")
    assert model._fused is None and isinstance(model.weights.layers[0].qkv, QuantizedLinear)
    cache = model.new_kv_cache(1, 64)
    slot = cache.allocate()
    logits = model.forward(torch.tensor([1, 2, 3]), torch.full((3,), slot), torch.arange(3),
                           cache).logits
    assert logits.shape == (3, 96) and torch.isfinite(logits).all()


def test_decoder_layer_rejects_bad_inputs():
    fused, _ = int4_pair(tiny(LlamaConfig))
    w, layer = fused.weights, fused.weights.layers[0]
    cache = fused.new_kv_cache(1, 64)
    slot = cache.allocate()
    positions = torch.tensor([0, 1])
    cos = torch.ones(2, 32)
    args = dict(h=torch.zeros(2, 128, dtype=torch.bfloat16), cos=cos, sin=cos,
                table=cache.page_table.long(), slots=torch.full((2,), slot), positions=positions)

    def call(**changes):
        a = {**args, **changes}
        return fused._fused(a["h"], layer.input_norm, layer.post_norm, w.eps,
                            layer.qkv.quantized.kernel_args, None,
                            layer.o_proj.quantized.kernel_args, None,
                            layer.gate_up.quantized.kernel_args, None,
                            layer.down.quantized.kernel_args, None, a["cos"], a["sin"],
                            cache.k[0], cache.v[0], a["table"], a["slots"], a["positions"],
                            w.num_heads, w.num_kv_heads, w.scale)

    assert call().shape == (2, 128)
    with pytest.raises(RuntimeError, match="bfloat16"):
        call(h=torch.zeros(2, 128))
    with pytest.raises(RuntimeError, match="cos, sin"):
        call(cos=torch.ones(2, 16))
    with pytest.raises(RuntimeError, match="out of range"):
        call(positions=torch.tensor([0, 64]))
    with pytest.raises(RuntimeError, match="int64"):
        call(slots=torch.full((2,), slot, dtype=torch.int32))


def test_a_long_block_keeps_each_tokens_bits():
    """80 tokens of one slot in one step attend in groups of at most 32 tokens (64 query heads
    per call, 2 per KV head here), sharing key and value conversions only: every token's
    logits equal those of decoding it alone after the same prefix."""
    fused, _ = int4_pair(tiny(LlamaConfig, seed=3))
    seq = torch.randint(0, 96, (80,), generator=torch.Generator().manual_seed(1))
    cache = fused.new_kv_cache(1, 96)
    slot = cache.allocate(80)
    block = fused.forward(seq, torch.full((80,), slot), torch.arange(80), cache).logits
    cache = fused.new_kv_cache(1, 96)
    slot = cache.allocate(80)
    alone = torch.cat([fused.forward(seq[i:i + 1], torch.tensor([slot]), torch.tensor([i]),
                                     cache).logits for i in range(80)])
    assert torch.equal(block, alone)
