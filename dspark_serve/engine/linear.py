"""A linear layer whose weight is prepacked for oneDNN when that is faster: bfloat16 on CPU.

Measured on this project's CPU (2 cores, AVX512-BF16/AMX, SmolLM2-135M shapes, one thread,
CPU time): all 120 layer projections of one decode token take 43 ms with float32
``F.linear``, 37 ms with bfloat16 ``F.linear`` (its small-batch path is slow) and 22 ms with
the weight reordered once into oneDNN's blocked layout (``torch.ops.mkldnn``, the path
TorchInductor's CPU freezing uses); at 64 tokens 204 ms / 65 ms / 32 ms. The packed path
rounds like ``F.linear`` in bfloat16. Float32 stays on ``F.linear``: it is the exactness
reference, and packing does not help it at one token.

Row invariance: oneDNN picks its K blocking from the whole problem size (its AMX heuristic
sizes blocks against the L2 cache), and a split K reduction rounds differently. Measured on
this CPU (one thread): the down projection of SmolLM2-135M (K = 1536) gives other bits for
a row once a call has 130 rows or more, K = 3072 from 65 rows, K = 4864 from 33, K = 8960
from 12; K <= 1280 never up to 600 rows. A token's logits then depended on how many tokens
shared its step (a prefill chunk next to a verify block), and greedy speculative decoding
parted from plain decoding at near-ties. So a packed layer takes at most
``ROW_BUDGET // K`` rows per call (K = 576: 113, K = 1536: 42, K = 8960: 7), all of which
were measured to give every row the bits of a one-row call (1 and 2 threads; at 2 threads
one K = 8960 shape still breaks from 5 rows). Cost (SmolLM2-135M, one thread): none up to
42 tokens, ~5 % of a 64-token step, ~20 % of a 256-token prefill step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Most elements (rows * K) of the input of one packed call; see the module docstring.
ROW_BUDGET = 1 << 16


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

    __slots__ = ("weight", "bias", "_packed", "_max_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.bias = bias
        self._packed = None
        self.weight = weight
        self._max_rows = max(1, ROW_BUDGET // weight.shape[1])
        if pack and _can_pack(weight):
            # The batch-size argument is a layout hint (any row count works). With hint 1 each
            # row's result has the same bits for every row count up to ``_max_rows``; larger
            # hints break that for LM-head shapes and do not speed up one token.
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
            self.weight = None

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        return _by_row_chunks(self._call_packed, x, self._max_rows)

    def _call_packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def _by_row_chunks(fn, x: torch.Tensor, max_rows: int) -> torch.Tensor:
    """``fn`` over x [T, in] in calls of at most ``max_rows`` rows (row invariance)."""
    if x.shape[0] <= max_rows:
        return fn(x)
    return torch.cat([fn(part) for part in x.split(max_rows)])


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
    Row invariance: like ``Linear``, calls take at most ``ROW_BUDGET // K`` rows (measured
    bit-identical rows for 1..300-row calls of SmolLM2-135M's shapes).

    Args:
        weight: [out, in] float (in divisible by INT4_GROUP); bias: [out] or None.
    Raises:
        ValueError: a shape the kernel cannot take, or no int4 CPU kernel in this torch.
    """

    __slots__ = ("bias", "_packed", "_scales_zeros", "_max_rows")

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
        self._max_rows = max(1, ROW_BUDGET // in_f)

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32 weights this layer multiplies by, each rounded to bfloat16 (the
        kernel's output dtype); for tests and references."""
        eye = torch.eye(self._scales_zeros.shape[0] * INT4_GROUP, dtype=torch.bfloat16)
        return self._mm(eye).float().T

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = _by_row_chunks(self._mm, x, self._max_rows)
        return out if self.bias is None else out + self.bias

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(),
                                                          self._packed, INT4_GROUP,
                                                          self._scales_zeros)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                quantization: str = "none") -> Linear | Int4Linear:
    """The target's projection layer: ``Linear`` ("none") or ``Int4Linear`` ("int4").
    Raises ValueError for another quantization name (and as ``Int4Linear`` does)."""
    if quantization == "none":
        return Linear(weight, bias)
    if quantization == "int4":
        return Int4Linear(weight, bias)
    raise ValueError(f"quantization must be 'none' or 'int4', got {quantization!r}")


def flat_call(linear: Linear | Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear`` over x [..., in] -> [..., out] (``Linear`` itself takes [T, in])."""
    return linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


class _PackedForward:
    """An ``nn.Linear``'s forward replaced by a packed ``Linear`` (see ``pack_linears``)."""

    __slots__ = ("linear",)

    def __init__(self, linear: Linear):
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
