import torch

from dspark_serve.ops.page_table import PageTable


def test_grow_release_and_add_pages():
    pt = PageTable(num_slots=2, max_pages=3, num_pages=4, device="cpu")
    assert pt.table.tolist() == [[0, 1, 2], [3, 0, 1]] and pt.num_free == 4
    assert pt.grow(1, 2) and pt.grow(0, 1) and pt.grow(0, 1)     # growing to what it holds
    assert (pt.pages_of(1), pt.pages_of(0), pt.num_free) == ([0, 1], [2], 1)
    assert pt.table[1, :2].tolist() == [0, 1] and pt.table[0, 0] == 2
    assert not pt.grow(0, 3) and pt.pages_of(0) == [2] and pt.num_free == 1  # nothing taken
    pt.release(1)
    assert pt.grow(0, 3) and pt.pages_of(0) == [2, 0, 1]         # lowest free ids first
    assert not pt.grow(1, 2)
    pt.add_pages(4)
    assert pt.num_pages == 8 and pt.grow(1, 2) and pt.pages_of(1) == [3, 4]
    assert torch.equal(pt.table[1, :2], torch.tensor([3, 4]))
