"""The CPU quantized linear kernel (AVX512-VNNI or AVX2, whichever this CPU runs) against its
PyTorch reference: the arithmetic, the GGUF grids it keeps, row independence, and its errors."""
import pytest
import torch

from dspark_serve.ops.quantized_linear import (cpu_kernel, dequantize_weight,
                                               quantize_activations, quantize_weight,
                                               quantized_linear, quantized_linear_reference)

needs_kernel = pytest.mark.skipif(
    cpu_kernel() is None, reason="no AVX512-VNNI or AVX2 CPU, or no C++ toolchain for the kernel")


def test_quantize_activations_by_hand():
    """Per group of 32: dx = max |x| / 127, qx = round(x * 127 / max |x|), all-zero groups 0."""
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([2.0, -1.0, 0.5, 0.01])
    qx, dx = quantize_activations(x)
    assert qx[0, 0, :4].tolist() == [127.0, -64.0, 32.0, 1.0]   # -63.5 and 31.75 round to even
    assert dx[0].tolist() == [pytest.approx(2 / 127), 0.0] and not qx[0, 1].any()


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_keeps_gguf_grids(bits):
    """Weights already on a GGUF Q4_1 (d * q + m, q in 0..15 with 0 and 15 present) or Q8_0
    (d * q, |q| up to 127) grid with float16 d, m come back exactly."""
    gen = torch.Generator().manual_seed(bits)
    n, k = 32, 64
    d = (0.002 + torch.rand(n, k // 32, 1, generator=gen) * 0.01).half().double()
    if bits == 4:
        q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).double()
        q[..., 0], q[..., 1] = 0, 15
        m = (-8 * d - torch.rand(d.shape, generator=gen) * 0.01).half().double()
    else:
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).double()
        q[..., 0] = 127
        m = torch.zeros_like(d)
    weight = (d * q + m).view(n, k)
    assert torch.equal(dequantize_weight(quantize_weight(weight, bits)), weight.float())


def test_quantize_rejects_what_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="bits"):
        quantize_weight(torch.randn(16, 32), 3)
    with pytest.raises(ValueError, match="divisible"):
        quantize_weight(torch.randn(20, 32), 4)
    with pytest.raises(ValueError, match="divisible"):
        quantize_weight(torch.randn(16, 48), 8)
    with pytest.raises(ValueError, match="float16"):
        quantize_weight(torch.full((16, 32), 1e5), 4)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 21])
def test_kernel_equals_reference(bits, rows):
    """The kernel's bfloat16 output is its reference's exact value rounded (float32
    accumulation over groups: within bfloat16's half ulp, 2^-8 relative, plus 1e-5)."""
    gen = torch.Generator().manual_seed(rows)
    qw = quantize_weight(torch.randn(96, 576, generator=gen) * 0.05, bits)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    x[0, :32] = 0                                   # an all-zero activation group
    y = quantized_linear(x, qw)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
    reference = quantized_linear_reference(x, qw)
    assert ((y.double() - reference).abs() <= reference.abs() * 2 ** -8 + 1e-5).all()


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_rows_do_not_depend_on_row_or_thread_count(bits):
    gen = torch.Generator().manual_seed(0)
    qw = quantize_weight(torch.randn(320, 1536, generator=gen) * 0.05, bits)
    x = torch.randn(40, 1536, generator=gen).bfloat16()
    alone = torch.cat([quantized_linear(row[None], qw) for row in x])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (2, 8, 17, 40):
                assert torch.equal(quantized_linear(x[:rows], qw), alone[:rows])
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_kernel_binds_the_best_instruction_set_of_this_cpu():
    """AVX512-VNNI where the CPU has it, else the AVX2 build of the same kernels."""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = f.read().split()
    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags)
    assert cpu_kernel().isa() == ("avx512-vnni" if vnni else "avx2")


@needs_kernel
def test_kernel_rejects_bad_inputs():
    qw = quantize_weight(torch.randn(16, 64), 4)
    with pytest.raises(RuntimeError, match="columns"):
        quantized_linear(torch.randn(2, 32).bfloat16(), qw)
    kernel = cpu_kernel()
    with pytest.raises(RuntimeError, match="bits"):
        kernel.quantized_linear(torch.randn(2, 64).bfloat16(), (qw.packed, qw.scales, 5))
    q8 = quantize_weight(torch.randn(16, 64), 8)
    with pytest.raises(RuntimeError, match="scales"):
        kernel.quantized_linear(torch.randn(2, 64).bfloat16(), (q8.packed, q8.scales.float(), 8))
