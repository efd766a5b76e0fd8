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
        if x.shape[0] <= self._max_rows:
            return self._call_packed(x)
        return torch.cat([self._call_packed(part) for part in x.split(self._max_rows)])

    def _call_packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
