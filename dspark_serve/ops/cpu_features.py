"""What the CPU can do, where the numerics depend on it."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def native_bf16_cpu() -> bool:
    """Whether the CPU has bfloat16 dot products (AVX512-BF16 or AMX-BF16), read from
    /proc/cpuinfo (False where it cannot be read). Without them oneDNN emulates bfloat16, and
    how it rounds a row then depends on how many rows share the call, in its one-row linear
    path and in small matmuls alike (measured on a 2-core Intel Xeon with AVX512-VNNI only:
    ``model.linear`` pads one-row calls, ``ops.paged_attention`` multiplies in float32)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
