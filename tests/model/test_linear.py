import pytest
import torch
import torch.nn.functional as F

from dspark_serve.model import linear
from dspark_serve.model.linear import (INT4_GROUP, Int4Linear, Linear, QuantizedLinear,
                                       _by_row_chunks, _can_pack, make_head, make_linear,
                                       pack_linears, quantize_linears, row_limits)
from dspark_serve.ops.quantized_linear import cpu_kernel, quantized_linear_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear(dtype, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    layer = Linear(weight, bias)
    # Float32 always stays on F.linear; bfloat16 packs wherever oneDNN supports it.
    assert layer.packed == (dtype == torch.bfloat16 and _can_pack(weight))
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, 96)
    # Packed bfloat16 rounds like F.linear in bfloat16 (float32 accumulation, one rounding).
    torch.testing.assert_close(out.float(), F.linear(x, weight, bias).float(), atol=0.07,
                               rtol=1e-2)


def test_unpacked_on_request():
    weight = torch.randn(8, 4).bfloat16()
    layer = Linear(weight, pack=False)
    assert not layer.packed and layer.weight is weight
    x = torch.randn(2, 4).bfloat16()
    assert torch.equal(layer(x), F.linear(x, weight))


@pytest.mark.parametrize("shape", [(3072, 576), (49152, 576), (576, 1536)])
def test_packed_bfloat16_rows_do_not_depend_on_row_count(shape):
    """A row's output has the same bits whether it is multiplied alone or among others (the
    batch invariance of the bfloat16 target relies on it). Shapes of SmolLM2-135M's gate/up,
    LM head and down projection; in one oneDNN call of 300 rows the down projection (K =
    1536) changes the last bit of ~6 % of the rows on an AMX CPU."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen).bfloat16()
    if not _can_pack(weight):
        pytest.skip("oneDNN bfloat16 packing unavailable on this CPU")
    layer = Linear(weight)
    x = torch.randn(300, shape[1], generator=gen).bfloat16()
    alone = torch.cat([layer(x[i:i + 1]) for i in range(300)])
    for rows in (2, 17, 100, 300):
        assert torch.equal(layer(x[:rows]), alone[:rows])


def _kernel_like(single_row_differs: bool, same_up_to: int):
    """A fake matmul whose rows round differently in one-row calls and above ``same_up_to``
    rows, as oneDNN's GEMV path and K blockings do; records the row counts it was called with."""
    calls = []

    def call(x):
        calls.append(x.shape[0])
        y = x.float().sum(-1, keepdim=True)
        if (x.shape[0] == 1 and single_row_differs) or x.shape[0] > same_up_to:
            y = y + 1e-2
        return y.to(torch.bfloat16)
    return call, calls


@pytest.mark.parametrize("single_row_differs, same_up_to, native, expected", [
    (False, 10 ** 6, True, (1, 128)), (True, 10 ** 6, True, (2, 128)), (True, 5, True, (2, 5)),
    (False, 2, True, (1, 2)),
    # no bfloat16 dot products: one-row calls padded even where the probes saw no difference
    (False, 10 ** 6, False, (2, 128))])
def test_row_limits_finds_the_invariant_row_counts(single_row_differs, same_up_to, native,
                                                   expected, monkeypatch):
    monkeypatch.setattr(linear, "native_bf16_cpu", lambda: native)
    call, _ = _kernel_like(single_row_differs, same_up_to)
    key = ("fake", single_row_differs, same_up_to, native)
    assert row_limits(call, key, 64) == expected   # 64 << 16 rows: capped at MAX_ROWS = 128
    assert row_limits(lambda x: pytest.fail("probed twice"), key, 64) == expected


def test_row_chunks_pad_single_rows_and_cut_long_inputs():
    call, calls = _kernel_like(True, 5)
    x = torch.randn(13, 8).bfloat16()
    reference = torch.cat([call(torch.cat([row, row]))[:1] for row in x.split(1)])
    calls.clear()
    out = _by_row_chunks(call, x, 2, 5)          # 5 + 5 + 3
    assert calls == [5, 5, 3] and torch.equal(out, reference)
    calls.clear()
    out = _by_row_chunks(call, x[:11], 2, 5)     # 5 + 5 + 1 padded to 2
    assert calls == [5, 5, 2] and torch.equal(out, reference[:11])
    calls.clear()
    assert torch.equal(_by_row_chunks(call, x[:1], 2, 5), reference[:1]) and calls == [2]
    # no rows (a step whose prefill chunks need no logits): one empty call
    calls.clear()
    assert _by_row_chunks(call, x[:0], 2, 5).shape == (0, 1) and calls == [0]


def test_zero_rows():
    """A step whose prefill chunks need no logits calls the LM head with no rows."""
    packed = Linear(torch.randn(576, 1536).bfloat16())
    int4 = Int4Linear(torch.randn(64, 128))
    assert packed(torch.zeros(0, 1536).bfloat16()).shape == (0, 576)
    assert int4(torch.zeros(0, 128).bfloat16()).shape == (0, 64)


def test_pack_linears_keeps_parameters_and_matches_f_linear():
    gen = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.Linear(96, 8, bias=False))
    model = model.to(torch.bfloat16).requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 5, 40, generator=gen).bfloat16()   # leading dims kept
    expected = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight)
    packed = pack_linears(model)
    assert packed == (2 if _can_pack(model[0].weight) else 0)
    out = model(x)
    assert out.shape == (2, 5, 8) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=0.15, rtol=2e-2)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_quantize_linears_takes_the_shapes_the_kernel_takes():
    """Linears with out % 16 == 0 and in % 32 == 0 run 8-bit through our kernel (where it
    runs), the others keep their forward; parameters stay; outputs near F.linear."""
    gen = torch.Generator().manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    model = model.to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    expected = F.linear(x, model[0].weight, model[0].bias)
    count = quantize_linears(model)
    if cpu_kernel() is None:
        assert count == 0
        return
    assert count == 1 and "forward" not in vars(model[1])
    assert isinstance(model[0].forward.linear, QuantizedLinear)
    torch.testing.assert_close(model[0](x).float(), expected.float(), atol=0.03, rtol=0.03)
    assert model[0].weight.shape == (32, 64)


def test_pack_linears_leaves_float32_alone():
    layer = torch.nn.Linear(4, 3)
    assert pack_linears(layer) == 0 and "forward" not in vars(layer)


def _int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


needs_int4 = pytest.mark.skipif(not _int4_available(), reason="no int4 CPU kernel in this torch")


def _group_step(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] quantization step (max - min) / 15 of each weight's group."""
    groups = weight.view(weight.shape[0], -1, INT4_GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    return step.repeat_interleave(INT4_GROUP, dim=1)


@needs_int4
def test_int4_keeps_q4_1_weights_on_their_grid():
    """Weights that are GGUF Q4_1 blocks (w = d * q + m, q in 0..15 with 0 and 15 present)
    come back within bfloat16 rounding (the scale and zero are stored in bfloat16), far inside
    the half step a weight off the grid can be moved by."""
    gen = torch.Generator().manual_seed(3)
    out_f, in_f = 48, 96
    q = torch.randint(0, 16, (out_f, in_f // INT4_GROUP, INT4_GROUP), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    d = (0.002 + torch.rand(out_f, in_f // INT4_GROUP, 1, generator=gen) * 0.008).bfloat16().float()
    m = (-8 * d - torch.rand(d.shape, generator=gen) * 0.01).bfloat16().float()
    weight = (d * q + m).view(out_f, in_f)
    error = (Int4Linear(weight).dequantized() - weight).abs()
    assert (error <= 2 ** -7 * (weight.abs() + (m + 8 * d).abs().max())).all()
    assert (error < 0.05 * _group_step(weight)).all()


@needs_int4
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_int4_matches_its_dequantized_weights(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(64, 128, generator=gen) * 0.05
    bias = torch.randn(64, generator=gen).bfloat16()
    layer = Int4Linear(weight, bias)
    assert layer.weight is None
    # at most half a step off (plus the bfloat16 rounding of scale, zero and output)
    error = (layer.dequantized() - weight).abs()
    assert (error <= 0.5 * _group_step(weight) + 2 ** -7 * (weight.abs() + 0.3)).all()
    assert error.mean() < 0.3 * _group_step(weight).mean()
    x = torch.randn(rows, 128, generator=gen).bfloat16()
    expected = x.float() @ layer.dequantized().T + bias.float()
    torch.testing.assert_close(layer(x).float(), expected, atol=0.05, rtol=1e-2)


@needs_int4
@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536), (49152, 576)])
def test_int4_rows_do_not_depend_on_row_count(shape):
    """As for bfloat16 (above): a row's bits are the same in calls of any row count."""
    gen = torch.Generator().manual_seed(0)
    layer = Int4Linear(torch.randn(shape, generator=gen) * 0.05)
    x = torch.randn(300, shape[1], generator=gen).bfloat16()
    alone = torch.cat([layer(x[i:i + 1]) for i in range(300)])
    for rows in (2, 17, 100, 300):
        assert torch.equal(layer(x[:rows]), alone[:rows])


@pytest.mark.parametrize("shape", [(64, 100), (60, 64)])
def test_int4_rejects_shapes_the_kernel_cannot_take(shape):
    with pytest.raises(ValueError, match="divisible"):
        Int4Linear(torch.randn(shape))


def test_int4_layers_use_our_kernel_where_it_runs():
    """"int4" projections are ``QuantizedLinear`` (AVX512-VNNI or AVX2) where the kernel runs, torch's
    ``Int4Linear`` elsewhere; the LM head is 8-bit only with our kernel."""
    weight, bias = torch.randn(64, 128) * 0.05, torch.randn(64).bfloat16()
    layer, head = make_linear(weight, bias, "int4"), make_head(weight, "int4")
    if cpu_kernel() is None:
        assert isinstance(layer, Int4Linear) and isinstance(head, Linear)
        return
    assert isinstance(layer, QuantizedLinear) and layer.quantized.bits == 4
    assert isinstance(head, QuantizedLinear) and head.quantized.bits == 8
    assert isinstance(make_head(weight), Linear)
    x = torch.randn(3, 128).bfloat16()
    expected = (quantized_linear_reference(x, layer.quantized).float().bfloat16().float()
                + bias.float())
    torch.testing.assert_close(layer(x).float(), expected, atol=0.02, rtol=1e-2)


def test_make_linear_rejects_unknown_quantization():
    with pytest.raises(ValueError, match="quantization"):
        make_linear(torch.randn(8, 32), None, "int3")
