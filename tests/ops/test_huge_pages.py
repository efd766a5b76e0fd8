"""Weights moved onto transparent huge pages: equal copies, aligned, one buffer."""
import pytest
import torch

from dspark_serve.ops.huge_pages import ALIGN, HUGE_PAGE, on_huge_pages


def test_copies_are_equal_aligned_and_share_one_huge_page_aligned_buffer():
    tensors = [torch.randint(0, 255, (3, 5, 7), dtype=torch.uint8),
               torch.randn(33, 17).half(), torch.randn(4, 3, dtype=torch.bfloat16),
               torch.arange(10)]
    moved = on_huge_pages(tensors)
    assert all(m.dtype == t.dtype and torch.equal(m, t) for m, t in zip(moved, tensors))
    assert all(m.data_ptr() % ALIGN == 0 for m in moved)
    assert moved[0].data_ptr() % HUGE_PAGE == 0
    assert len({m.untyped_storage().data_ptr() for m in moved}) == 1
    assert all(m.data_ptr() != t.data_ptr() for m, t in zip(moved, tensors))


def test_only_cpu_tensors():
    with pytest.raises(ValueError, match="CPU tensors only"):
        on_huge_pages([torch.empty(2, device="meta")])
