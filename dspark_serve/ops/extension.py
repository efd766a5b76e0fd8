"""The compiled CUDA extension (``dspark_serve._C``, built from ``csrc/`` by setup.py) and the
rule the dispatchers use to pick it: CUDA tensors and a loadable extension."""
from __future__ import annotations

import functools
import importlib.util
import warnings

import torch


@functools.lru_cache(maxsize=None)
def cuda_ops_available() -> bool:
    """True when ``torch.ops.dspark`` holds the CUDA kernels.

    The extension registers its ops with ``TORCH_LIBRARY`` and has no Python module init,
    so it is loaded with ``torch.ops.load_library``. A build that does not load (for
    example one compiled against another torch) is reported once and ignored, so callers
    fall back to the PyTorch references.
    """
    spec = importlib.util.find_spec("dspark_serve._C")
    if spec is None or spec.origin is None:
        return False
    try:
        torch.ops.load_library(spec.origin)
    except (OSError, RuntimeError) as exc:
        warnings.warn(f"dspark_serve._C at {spec.origin} does not load ({exc}); using the "
                      f"PyTorch references. Rebuild with: python setup.py build_ext --inplace",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def use_cuda_kernel(*tensors: torch.Tensor) -> bool:
    """Whether a dispatcher should call the CUDA op for these inputs."""
    return all(t.is_cuda for t in tensors) and cuda_ops_available()


def capturing() -> bool:
    """True inside CUDA graph capture, where value checks (host syncs) must be skipped."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
