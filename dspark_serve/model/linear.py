"""A linear layer whose weight is prepacked for oneDNN when that is faster: bfloat16 on CPU.

Measured on this project's CPU (2 cores, AVX512-BF16/AMX, SmolLM2-135M shapes, one thread,
CPU time): all 120 layer projections of one decode token take 43 ms with float32
``F.linear``, 37 ms with bfloat16 ``F.linear`` (its small-batch path is slow) and 22 ms with
the weight reordered once into oneDNN's blocked layout (``torch.ops.mkldnn``, the path
TorchInductor's CPU freezing uses); at 64 tokens 204 ms / 65 ms / 32 ms. The packed path
rounds like ``F.linear`` in bfloat16. Float32 stays on ``F.linear``: it is the exactness
reference, and packing does not help it at one token.

Row invariance: oneDNN picks its kernel and K blocking from the whole problem shape, and a
split K reduction rounds differently, so a row's bits can depend on how many rows share the
call. A token's logits then depend on how many tokens share its step (a prefill chunk next to
a verify block), and greedy speculative decoding parts from plain decoding at near-ties. Where
that happens is a property of the CPU. On AVX512-BF16 + AMX, one-row calls match multi-row
ones, and the down projection of SmolLM2-135M (K = 1536) changed rows from 130 rows per call,
K = 8960 from 12. On AVX512-BF16 without AMX, one-row calls take a GEMV path that rounds
differently for K >= 1536 (seen from 2 rows on), while 2..ROW_BUDGET // K rows all agree.
Without bfloat16 dot products (AVX512-VNNI only), one-row calls differ in a few rows per
thousand even at K = 64, too rarely for the probes: one row is always padded there. So
``row_limits`` probes each layer shape once per process and calls keep to the row counts that
gave every row the same bits; a single row is then padded to two where needed. Cost
(SmolLM2-135M): ~1.5 ms of a ~17 ms decode step without AMX (the padded down projection); with
AMX ~5 % of a 64-token step and ~20 % of a 256-token prefill step; ~3 s of probes at engine
start. A layer keeps the limits of the thread count it was built under.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_serve.ops.cpu_features import native_bf16_cpu
from dspark_serve.ops.quantized_linear import (cpu_kernel, dequantize_weight, quantize_weight,
                                               quantized_linear)

# Most elements (rows * K) of the input of one call; see the module docstring.
ROW_BUDGET = 1 << 16
# Most rows of one call (the probe's cost grows with its square: ~1 min for K = 64 at 1024).
MAX_ROWS = 128
# (layer kind, out, in, bias, threads) -> (min_rows, max_rows) per call (see row_limits)
_ROW_LIMITS: dict[tuple, tuple[int, int]] = {}


def row_limits(call, key: tuple, in_features: int) -> tuple[int, int]:
    """(min_rows, max_rows) of calls that give every row the same bits on this CPU, measured
    with two random bfloat16 inputs the first time a layer shape (``key``) meets the current
    thread count.

    The reference is each row computed in a two-row call. max_rows: the most rows m <=
    clamp(ROW_BUDGET // in_features, 2, MAX_ROWS) such that calls of 2..m rows all match it.
    min_rows: 1 if one-row calls match it too, else 2 (oneDNN without AMX takes a GEMV path
    at one row that rounds differently from its GEMM; such rows are then computed in a padded
    two-row call). The kernel choice depends on the problem shape, not the values, and a
    changed reduction order shows in some of the outputs. Takes ~0.1-2 s per shape (the LM
    head's is the largest; ~3 s for SmolLM2-135M's target and drafter together).
    """
    key = (*key, torch.get_num_threads())
    if key not in _ROW_LIMITS:
        gen = torch.Generator().manual_seed(0)
        min_rows = 1 if native_bf16_cpu() else 2
        max_rows = min(max(2, ROW_BUDGET // in_features), MAX_ROWS)
        for _ in range(2):
            x = torch.randn(max_rows, in_features, generator=gen).to(torch.bfloat16)
            paired = torch.cat([call(row.expand(2, -1))[:1] for row in x.split(1)])
            if min_rows == 1 and not torch.equal(torch.cat([call(row) for row in x.split(1)]),
                                                 paired):
                min_rows = 2
            m = 2
            while m < max_rows and torch.equal(call(x[:m + 1]), paired[:m + 1]):
                m += 1
            max_rows = m
        _ROW_LIMITS[key] = (min_rows, max_rows)
    return _ROW_LIMITS[key]


def _can_pack(weight: torch.Tensor) -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise")
            and bool(mkldnn._is_mkldnn_bf16_supported()))


class Linear:
    """``y = x @ weight.T + bias`` for x [T, in] -> [T, out] in the weight's dtype.

    Args:
        weight: [out, in]; bias: [out] or None.
        pack: allow the oneDNN prepacked layout (used only where ``_can_pack``). A packed
            layer keeps no plain copy of its weight (``weight`` is then None).
    """

    __slots__ = ("weight", "bias", "_packed", "_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.bias = bias
        self._packed = None
        self.weight = weight
        self._rows = (1, min(max(1, ROW_BUDGET // weight.shape[1]), MAX_ROWS))
        if pack and _can_pack(weight):
            # The batch-size argument is a layout hint (any row count works). Hint 1 keeps rows
            # invariant over the most row counts; larger hints break it for LM-head shapes
            # and do not speed up one token.
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
            self.weight = None
            self._rows = row_limits(self._call_packed,
                                    ("packed", *weight.shape, bias is not None), weight.shape[1])

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        return _by_row_chunks(self._call_packed, x, *self._rows)

    def _call_packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def _by_row_chunks(fn, x: torch.Tensor, min_rows: int, max_rows: int) -> torch.Tensor:
    """``fn`` over x [T, in] in calls of min_rows..max_rows rows (row invariance; a shorter
    piece is padded with copies of its first row)."""
    if x.shape[0] == 0 or min_rows <= x.shape[0] <= max_rows:
        return fn(x)
    parts = []
    for part in x.split(max_rows):
        n = part.shape[0]
        if n < min_rows:
            part = torch.cat([part, part[:1].expand(min_rows - n, -1)])
        parts.append(fn(part)[:n])
    return torch.cat(parts)


# Weights per int4 scale/zero pair: GGUF Q4_1's block, so a Q4_1 model keeps its own 4-bit grid
# (up to its scale and zero rounded to bfloat16).
INT4_GROUP = 32


def _can_int4(weight: torch.Tensor) -> bool:
    aten = torch.ops.aten
    return (weight.device.type == "cpu" and weight.dim() == 2
            and hasattr(aten, "_convert_weight_to_int4pack_for_cpu")
            and hasattr(aten, "_weight_int4pack_mm_for_cpu"))


class Int4Linear:
    """``y = x @ W.T + bias`` with W stored as 4-bit integers, one bfloat16 scale and zero per
    ``INT4_GROUP`` weights of a row (asymmetric, GGUF Q4_1's layout: w = scale * (q - 8) +
    zero, q in 0..15, scale = (max - min) / 15 of the group). Activations stay bfloat16.

    Why: a CPU decode step at a few tokens reads every weight once, so its time is memory
    bandwidth; 4-bit weights read ~3.7x less than bfloat16 (measured on this project's CPU, one
    thread, all SmolLM2-135M projections: 13.6 ms instead of 62 ms at one token, 44 ms instead of
    63 ms at 8 tokens). The kernel's time grows with the rows, so prefill and large verify
    batches are slower than bfloat16 on AMX: a choice for low concurrency.
    Row invariance: like ``Linear``, calls take at most the rows ``row_limits`` measured.

    Args:
        weight: [out, in] float (in divisible by INT4_GROUP); bias: [out] or None.
    Raises:
        ValueError: a shape the kernel cannot take, or no int4 CPU kernel in this torch.
    """

    __slots__ = ("bias", "_packed", "_scales_zeros", "_rows")

    weight = None   # no plain copy is kept

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        out_f, in_f = weight.shape
        if not _can_int4(weight):
            raise ValueError("int4 weights need a CPU tensor and torch's int4 CPU kernels")
        if in_f % INT4_GROUP or out_f % 16:
            raise ValueError(f"int4 weights need in_features divisible by {INT4_GROUP} and "
                             f"out_features by 16, got {tuple(weight.shape)}")
        groups = weight.float().view(out_f, in_f // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
        self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).view(out_f, in_f), 1)
        # [in / group, out, 2] (scale, zero) with zero = w at q = 8
        self._scales_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1) \
            .contiguous().to(torch.bfloat16)
        self.bias = bias
        self._rows = row_limits(self._mm, ("int4", out_f, in_f), in_f)

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32 weights this layer multiplies by, each rounded to bfloat16 (the
        kernel's output dtype); for tests and references."""
        eye = torch.eye(self._scales_zeros.shape[0] * INT4_GROUP, dtype=torch.bfloat16)
        return self._mm(eye).float().T

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = _by_row_chunks(self._mm, x, *self._rows)
        return out if self.bias is None else out + self.bias

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(),
                                                          self._packed, INT4_GROUP,
                                                          self._scales_zeros)


class QuantizedLinear:
    """``y = x @ W.T + bias`` through our CPU kernel (AVX512-VNNI or AVX2)
    (``dspark_serve.ops.quantized_linear``): W in groups of 32 weights, 4-bit on the GGUF
    Q4_1 grid or 8-bit on the Q8_0 grid, float16 scales; activations quantized to int8 per
    group of 32 (llama.cpp's arithmetic for these files). Faster than ``Int4Linear`` at every
    row count and nearly flat in the rows up to 4 (SmolLM2-135M projections, one thread, AMD
    EPYC: 3.5 / 4.8 / 8.4 ms at 1 / 4 / 8 rows, against 7.3 / 12.0 / 22.8 ms). Every row is
    computed on its own, so rows never depend on the row count (no ``row_limits`` probe).

    Args:
        weight: [out, in] float (out divisible by 16, in by 32); bias: [out] or None; bits: 4 or 8.
    Raises:
        ValueError: no kernel on this machine (``cpu_kernel()`` is None), or as
            ``quantize_weight``.
    """

    __slots__ = ("bias", "quantized", "kernel")

    weight = None   # no plain copy is kept

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, bits: int = 4):
        self.kernel = cpu_kernel()
        if self.kernel is None:
            raise ValueError("QuantizedLinear needs the CPU kernel (ops.quantized_linear: "
                             "AVX512-VNNI or AVX2 + FMA + F16C)")
        self.quantized = quantize_weight(weight, bits)
        self.bias = bias

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32 weights on the quantization grid (the kernel also quantizes its
        input; ``quantized_linear_reference`` is its exact arithmetic)."""
        return dequantize_weight(self.quantized)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = quantized_linear(x, self.quantized, self.kernel)
        return out if self.bias is None else out + self.bias


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                quantization: str = "none") -> Linear | Int4Linear | QuantizedLinear:
    """The target's projection layer: ``Linear`` ("none"), or for "int4" ``QuantizedLinear``
    where its kernel runs (AVX512-VNNI or AVX2) and ``Int4Linear`` elsewhere.
    Raises ValueError for another quantization name (and as the layers do)."""
    if quantization == "none":
        return Linear(weight, bias)
    if quantization == "int4":
        if cpu_kernel() is not None and weight.device.type == "cpu":
            return QuantizedLinear(weight, bias, bits=4)
        return Int4Linear(weight, bias)
    raise ValueError(f"quantization must be 'none' or 'int4', got {quantization!r}")


def make_head(weight: torch.Tensor, quantization: str = "none") -> Linear | QuantizedLinear:
    """The target's LM head: 8-bit (GGUF Q8_0's grid, which is how GGUF Q4 files store
    SmolLM2's tied embedding) under "int4" where the kernel runs (0.7 ms instead of ~5 ms
    for SmolLM2-135M's 49k-row head at one token), else ``Linear`` in the model dtype."""
    if (quantization == "int4" and cpu_kernel() is not None and weight.device.type == "cpu"
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0):
        return QuantizedLinear(weight, None, bits=8)
    return Linear(weight)


def flat_call(linear: Linear | Int4Linear | QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """``linear`` over x [..., in] -> [..., out] (``Linear`` itself takes [T, in])."""
    return linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


class _PackedForward:
    """An ``nn.Linear``'s forward replaced by a packed ``Linear`` or a ``QuantizedLinear``
    (see ``pack_linears``, ``quantize_linears``)."""

    __slots__ = ("linear",)

    def __init__(self, linear: Linear | QuantizedLinear):
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return flat_call(self.linear, x)


def pack_linears(module: nn.Module) -> int:
    """Run every packable ``nn.Linear`` inside ``module`` (bfloat16 on a CPU with oneDNN
    bf16) on a prepacked copy of its weight: 1.5-2x faster for the few rows a drafter feeds
    (measured: the drafter's block pass at one request, 17 -> 9 ms on this project's CPU).

    For inference modules only: the modules keep their parameters (``state_dict`` and
    checkpoints are unchanged, at the memory of a second copy), but calls no longer see later
    changes to them and carry no gradient. Returns the number of layers packed.
    """
    count = 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and _can_pack(sub.weight):
            bias = None if sub.bias is None else sub.bias.detach()
            sub.forward = _PackedForward(Linear(sub.weight.detach(), bias))
            count += 1
    return count


def quantize_linears(module: nn.Module, bits: int = 8) -> int:
    """Run every ``nn.Linear`` inside ``module`` whose shape the kernel takes (out divisible
    by 16, in by 32; CPU) on a ``QuantizedLinear`` copy of its weight (``bits`` 4 or 8), where
    the kernel runs: the drafter of an int4 target reads ~2x fewer weight bytes per draft
    than with ``pack_linears``. Speculative decoding stays lossless (verification uses the
    draft distributions the quantized drafter produced). Same caveats as ``pack_linears``
    (inference only, parameters kept). Returns the number of layers quantized (0 without the
    kernel)."""
    if cpu_kernel() is None:
        return 0
    count = 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and sub.weight.device.type == "cpu" and \
                sub.out_features % 16 == 0 and sub.in_features % 32 == 0:
            bias = None if sub.bias is None else sub.bias.detach().to(torch.bfloat16)
            sub.forward = _PackedForward(QuantizedLinear(sub.weight.detach(), bias, bits))
            count += 1
    return count
