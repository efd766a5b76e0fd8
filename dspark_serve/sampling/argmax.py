"""Row argmax on the serving hot path (greedy verification, greedy draws).

torch's CPU ``argmax`` over the vocabulary is slow: one thread, float32 [16, 49152] logits,
1.34 ms against NumPy's 0.11 ms (1 row: 82 vs 7 us), ~3 % of a 16-user decode step of the
int4 SmolLM2 target (2-core Intel Xeon, 2026-12-05). NumPy's argmax has the same semantics
(the first of equal maxima; a NaN counts as the maximum, the first one wins), so CPU float
tensors go through it; anything else keeps torch's.
"""
from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = (torch.float32, torch.float64)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``, faster on the CPU.

    Args:
        x: [..., V] float tensor, V >= 1.
    Returns:
        [...] int64 on x's device: the index of the first maximum of each row (NaN as the
        maximum, like torch).
    Raises:
        IndexError / RuntimeError as ``torch.argmax`` for a 0-dim tensor or V = 0.
    """
    if x.device.type != "cpu" or x.dtype not in _NUMPY_DTYPES or x.requires_grad \
            or x.dim() == 0 or x.shape[-1] == 0:
        return x.argmax(dim=-1)
    return torch.as_tensor(np.asarray(x.numpy().argmax(axis=-1), dtype=np.int64))
