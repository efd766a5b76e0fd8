"""The drafter's compiled CPU path (an int4 target's drafter): ``compile_layers`` (the draft
layers as one ``draft_layer`` call each) against the float64 masked-attention reference on the
same 4-bit or 8-bit weight grid, and ``compile_draw`` (the Markov draw as one ``markov_draw``
call): each token is the inverse-CDF pick of the distribution returned for it, that
distribution is softmax((U + W2 W1[x_{k-1}]) / T), greedy rows take its argmax, and draws over
many uniforms follow it (chi-square)."""
import pytest
import torch
from scipy import stats

from dspark_serve.drafter.block_sampler import sample_block
from dspark_serve.ops.quantized_linear import cpu_kernel, dequantize_weight, quantize_weight
from dspark_serve.types import SamplingTensors

pytestmark = pytest.mark.skipif(
    cpu_kernel() is None, reason="no AVX512-VNNI or AVX2 CPU, or no C++ toolchain for the kernel")

# Shapes the kernel takes: head_dim 64, hidden and intermediate sizes multiples of 32, Markov
# rank a multiple of 32, vocabulary a multiple of 16.
SIZES = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=256, vocab_size=96, mask_token_id=95, markov_rank=32,
             block_size=5)


def compiled_drafter(tiny_config, tiny_drafter, seed=0, bits=8, grid=None, **extra):
    """(bfloat16 drafter with compiled layers of ``bits``-bit weights and the draw, its config):
    every linear of the backbone already on the ``grid``-bit grid (default: ``bits``) and W2 on
    the 8-bit one, so the float64 reference sees the weights the kernel multiplies by."""
    cfg = tiny_config(**{**SIZES, **extra})
    drafter = tiny_drafter(cfg, seed=seed)
    with torch.no_grad():
        for name, module in drafter.named_modules():
            if isinstance(module, torch.nn.Linear) and (".layers." in name
                                                        or name == "backbone.fc"):
                module.weight.copy_(dequantize_weight(quantize_weight(module.weight, grid or bits)))
        w2 = drafter.markov_head.markov_w2.weight
        w2.copy_(dequantize_weight(quantize_weight(w2, 8)))
    drafter = drafter.to(torch.bfloat16).requires_grad_(False)
    for module in drafter.shared_modules:   # the target's embedding and LM head
        module.to(torch.bfloat16)
    assert drafter.backbone.compile_layers(bits) and drafter.markov_head.compile_draw()
    return drafter, cfg


@pytest.mark.parametrize("bits", [4, 8])
def test_compiled_layers_match_the_masked_attention_reference(tiny_config, tiny_drafter,
                                                              reference_block_hidden, bits):
    """Three slots with different context lengths (positions past an anchor are cached but
    must stay invisible; the block is bidirectional): within 5 % of the float64 reference
    (int8 activations, bfloat16 context; measured 2.4-3.2 %), while a causal block (> 10 %)
    or one context position too many (> twice the error) moves the reference further."""
    drafter, cfg = compiled_drafter(tiny_config, tiny_drafter, bits=bits)
    gen = torch.Generator().manual_seed(1)
    lengths = {0: 40, 1: 3, 2: 70}
    taps = {s: torch.randn(n, cfg.context_dim, generator=gen) for s, n in lengths.items()}
    cache = drafter.new_cache(3, 96)
    for s, t in taps.items():
        drafter.extend_context(cache, torch.full((len(t),), s), torch.arange(len(t)),
                               t.to(torch.bfloat16))
    slots, anchors = torch.tensor([2, 0, 1]), torch.tensor([5, 17, 33])
    anchor_pos = torch.tensor([64, 21, 3])   # slots 2 and 0 hold context past their anchors
    hidden, _ = drafter.block_forward(cache, slots, anchors, anchor_pos)
    full = drafter.backbone.compiled_forward(
        drafter.shared_modules[0](torch.where(torch.arange(cfg.block_size) == 0,
                                              anchors[:, None], cfg.mask_token_id)),
        anchor_pos[:, None] + torch.arange(cfg.block_size), cache, slots, anchor_pos)
    torch.testing.assert_close(full[:, cfg.label_offset:], hidden)
    for row, (slot, anchor, pos) in enumerate(zip(slots.tolist(), anchors.tolist(),
                                                  anchor_pos.tolist())):
        ctx = taps[slot].to(torch.bfloat16)
        ref = reference_block_hidden(drafter, ctx, anchor, pos)
        rel = lambda x: float((x.double() - ref).norm() / ref.norm())
        causal = reference_block_hidden(drafter, ctx, anchor, pos, causal_block=True)
        assert rel(full[row]) < 0.05 and rel(causal) > 0.1, (row, rel(full[row]))
        if pos < lengths[slot]:
            leaky = reference_block_hidden(drafter, ctx[:pos + 1], anchor, pos + 1)
            assert rel(leaky) > 2 * rel(full[row])


def test_compiled_layers_take_the_requested_weight_bits(tiny_config, tiny_drafter,
                                                       reference_block_hidden):
    """Weights on the 8-bit grid compiled at 4 bits are requantized (a second rounding the
    reference does not see): more than twice as far from it as the same weights at 8 bits."""
    errors = {}
    for bits in (8, 4):
        drafter, cfg = compiled_drafter(tiny_config, tiny_drafter, seed=3, bits=bits, grid=8)
        taps = torch.randn(20, cfg.context_dim, generator=torch.Generator().manual_seed(2))
        cache = drafter.new_cache(1, 32)
        drafter.extend_context(cache, torch.zeros(20, dtype=torch.long), torch.arange(20),
                               taps.to(torch.bfloat16))
        hidden, _ = drafter.block_forward(cache, torch.tensor([0]), torch.tensor([9]),
                                          torch.tensor([20]))
        ref = reference_block_hidden(drafter, taps.to(torch.bfloat16), 9, 20)[cfg.label_offset:]
        errors[bits] = float((hidden[0].double() - ref).norm() / ref.norm())
    assert errors[8] < 0.05 and errors[4] > 2 * errors[8], errors


def test_compiled_short_draft_matches_the_reference_of_a_short_block(tiny_config, tiny_drafter,
                                                                     reference_block_hidden):
    """num_drafts = 2 through the compiled layers: within 5 % of the float64 reference of the
    same weights with a 2-slot block (int8 activations), and further from the full block's
    first two rows."""
    drafter, cfg = compiled_drafter(tiny_config, tiny_drafter, seed=4)
    short, _ = compiled_drafter(tiny_config, tiny_drafter, seed=4, block_size=2)
    taps = torch.randn(30, cfg.context_dim, generator=torch.Generator().manual_seed(6))
    cache = drafter.new_cache(1, 40)
    drafter.extend_context(cache, torch.zeros(30, dtype=torch.long), torch.arange(30),
                           taps.to(torch.bfloat16))
    args = (cache, torch.tensor([0]), torch.tensor([7]), torch.tensor([30]))
    hidden, _ = drafter.block_forward(*args, num_drafts=2)
    full, _ = drafter.block_forward(*args)
    ref = reference_block_hidden(short, taps.to(torch.bfloat16), 7, 30)
    rel = lambda x: float((x.double() - ref).norm() / ref.norm())
    assert hidden.shape[1] == 2 and rel(hidden[0]) < 0.05 and rel(full[0, :2]) > 0.1


@pytest.mark.parametrize("bits", [4, 8])
def test_compiled_context_matches_the_python_projection(tiny_config, tiny_drafter, bits):
    """h_ctx and every layer's context keys / values from one ``draft_context`` call: within
    2 % of the float32 modules on the same weight grid (fc included), and extend_context
    stores them."""
    drafter, cfg = compiled_drafter(tiny_config, tiny_drafter, seed=8, bits=bits,
                                    anchor_context=True)
    taps = torch.randn(9, cfg.context_dim, generator=torch.Generator().manual_seed(9))
    positions = torch.arange(9)
    h, k, v = drafter.backbone.compiled_context(taps, positions)
    ref = drafter.backbone.float()
    h_ref = ref.context_state(taps.to(torch.bfloat16).float())
    k_ref, v_ref = ref.context_kv(h_ref, positions)
    drafter.backbone.to(torch.bfloat16)
    for got, want in ((h, h_ref), (k, k_ref), (v, v_ref)):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert float((got.float() - want).norm() / want.norm()) < 0.02
    cache = drafter.new_cache(2, 64)
    drafter.extend_context(cache, torch.ones(9, dtype=torch.long), torch.arange(9), taps)
    assert torch.equal(cache.context(1, torch.tensor([1]), 9)[0][0], k[1])
    assert torch.equal(cache.states(torch.tensor([1]), torch.tensor([8]))[0], h[8])
    with pytest.raises(ValueError, match="positions"):
        drafter.backbone.compiled_context(taps, positions[:3])


def _markov_logits(drafter, base_logits, prev):
    """U + W2 W1[prev] in float64: base [R, V], prev [R] -> [R, V]."""
    head = drafter.markov_head
    return (base_logits.double()
            + head.markov_w1.weight.double()[prev] @ head.markov_w2.weight.double().T)


def test_compiled_draw_picks_by_inverse_cdf_of_the_markov_distribution(tiny_config,
                                                                       tiny_drafter):
    """Rows at temperatures 0 (greedy), 0.7 and 1.3: the returned distribution of position k
    is softmax((U_k + W2 W1[x_{k-1}]) / T) for the drawn x_{k-1} (to the int8 activations'
    error), the drawn token its inverse-CDF pick at u, and greedy rows' token its argmax."""
    drafter, cfg = compiled_drafter(tiny_config, tiny_drafter, seed=2)
    head, gamma, r = drafter.markov_head, cfg.gamma, 6
    gen = torch.Generator().manual_seed(3)
    base = (2 * torch.randn(r, gamma, cfg.vocab_size, generator=gen)).to(torch.bfloat16)
    anchors = torch.randint(0, cfg.vocab_size, (r,), generator=gen)
    temps = torch.tensor([0.0, 0.7, 1.3, 0.0, 0.7, 1.3])
    uniforms = torch.rand(r, gamma, generator=gen)
    tokens, probs = head.draw(base, anchors, temps, uniforms, None, 1e-5, want_probs=True)
    prev = torch.cat([anchors[:, None], tokens[:, :-1]], 1)
    for k in range(gamma):
        logits = _markov_logits(drafter, base[:, k], prev[:, k])
        for i in range(r):
            if temps[i] == 0:
                assert int(tokens[i, k]) == int(logits[i].argmax())
                assert probs[i, k].tolist() == torch.nn.functional.one_hot(
                    tokens[i, k], cfg.vocab_size).float().tolist()
                continue
            want = torch.softmax(logits[i] / float(temps[i]), -1)
            assert float((probs[i, k].double() - want).abs().max()) < 2e-2
            cdf = probs[i, k].double().cumsum(0)
            t = int(tokens[i, k])
            below = float(cdf[t - 1]) if t else 0.0
            assert below - 1e-6 <= float(uniforms[i, k]) < float(cdf[t]) + 1e-6
    greedy_only, none = head.draw(base, anchors, torch.zeros(r), uniforms, None, 1e-5,
                                  want_probs=False)
    assert none is None and greedy_only[temps == 0].tolist() == tokens[temps == 0].tolist()


def test_compiled_draws_follow_the_returned_distribution(tiny_config, tiny_drafter):
    """4,000 draws of one block (same logits, fresh uniforms): the first token's counts fit
    the returned distribution (chi-square p > 1e-3), and so do the second token's given the
    most frequent first token."""
    drafter, cfg = compiled_drafter(tiny_config, tiny_drafter, seed=4)
    n = 4000
    gen = torch.Generator().manual_seed(5)
    base = (torch.randn(1, cfg.gamma, cfg.vocab_size, generator=gen)).to(torch.bfloat16)
    tokens, probs = drafter.markov_head.draw(
        base.expand(n, -1, -1), torch.full((n,), 7), torch.ones(n),
        torch.rand(n, cfg.gamma, generator=gen), None, 1e-5, want_probs=True)

    def fit(tok, p):
        p = p / p.sum()             # float32 probabilities sum to 1 only to rounding
        keep = p * len(tok) >= 5    # chi-square needs expected counts >= 5: pool the rest
        counts = torch.bincount(tok, minlength=cfg.vocab_size).double()
        obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
        exp = torch.cat([p[keep], p[~keep].sum()[None]]) * len(tok)
        return stats.chisquare(obs.numpy(), exp.numpy()).pvalue

    assert fit(tokens[:, 0], probs[0, 0].double()) > 1e-3
    first = int(tokens[:, 0].mode().values)
    rows = (tokens[:, 0] == first).nonzero().flatten()
    assert len(rows) > 200
    assert fit(tokens[rows, 1], probs[rows[0], 1].double()) > 1e-3


def test_sample_block_takes_the_compiled_draw_unless_rows_filter(tiny_config, tiny_drafter):
    """Greedy rounds return probs None (one-hot at the tokens) with the reference's tokens;
    rows with top-p take the PyTorch path (dense probabilities)."""
    drafter, cfg = compiled_drafter(tiny_config, tiny_drafter, seed=6)
    cache = drafter.new_cache(2, 32)
    taps = torch.randn(20, cfg.context_dim, generator=torch.Generator().manual_seed(7))
    drafter.extend_context(cache, torch.arange(2).repeat_interleave(10), torch.arange(10).repeat(2),
                           taps.to(torch.bfloat16))
    args = (cache, torch.arange(2), torch.tensor([3, 4]), torch.tensor([10, 10]))
    uniforms = torch.rand(2, cfg.gamma)
    greedy = drafter.draft(*args, SamplingTensors.uniform(2, temperature=0.0), uniforms)
    assert greedy.probs is None
    hidden, base = drafter.block_forward(*args)
    ref = sample_block(base.float(), hidden, args[2], drafter.markov_head, None,
                       SamplingTensors.uniform(2, temperature=0.0), uniforms)
    assert greedy.tokens.tolist() == ref.tokens.tolist()
    filtered = drafter.draft(*args, SamplingTensors.uniform(2, temperature=1.0, top_p=0.9),
                             uniforms)
    assert filtered.probs.shape == (2, cfg.gamma, cfg.vocab_size)
    picked = filtered.probs.gather(2, filtered.tokens[..., None])
    assert bool((picked > 0).all())
