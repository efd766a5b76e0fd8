"""One buffer on transparent huge pages for the weights every decode step streams.

A CPU decode step reads every projection's weights from memory (~60 MB for SmolLM2-135M in
int4 with its 8-bit head). In 4 KB pages that is ~15k pages a step, each a TLB miss once the
stream has evicted the previous layer's entries, and in a VM each miss walks two page tables;
it also leaves the step's small tensors cold between layers (a copy of 9 KB after a decoder
layer took ~30 us instead of ~3). In 2 MB pages the stream needs ~30 entries. Linux backs a
``madvise(MADV_HUGEPAGE)`` range with huge pages when transparent huge pages are ``always``
or ``madvise`` (the common default); elsewhere the buffer is ordinary memory and nothing
changes but the speed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14     # linux/mman.h
ALIGN = 64             # each tensor starts on a cache line (the kernels' vector loads)


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask Linux to back ``length`` bytes from ``address`` (both multiples of ``HUGE_PAGE``)
    with transparent huge pages; False where that is not available (not Linux, THP off)."""
    libc = _libc()
    return libc is not None and libc.madvise(address, length, MADV_HUGEPAGE) == 0


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU ``tensors`` (any dtypes and shapes), equal to them, laid out in one new
    2 MB-aligned buffer advised for transparent huge pages before its first touch (so its
    pages are huge from the first fault). Returns them in order; the buffer lives as long as
    any of them. Raises ValueError for a tensor not on the CPU."""
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("huge pages hold CPU tensors only")
    starts, size = [], 0
    for t in tensors:
        starts.append(size)
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if not size:
        return [t.clone() for t in tensors]
    length = -(-size // HUGE_PAGE) * HUGE_PAGE
    buffer = torch.empty(length + HUGE_PAGE, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE
    advise_huge_pages(buffer.data_ptr() + offset, length)
    out = []
    for t, start in zip(tensors, starts):
        nbytes = t.numel() * t.element_size()
        view = buffer[offset + start:offset + start + nbytes].view(t.dtype).view(t.shape)
        out.append(view.copy_(t))
    return out
