"""``row_argmax`` returns exactly what ``torch.argmax(dim=-1)`` returns: the first of equal
maxima, NaN as the maximum, any leading shape and strides, and torch's own path for dtypes
NumPy does not take."""
import pytest
import torch

from dspark_serve.sampling.argmax import row_argmax

NAN, INF = float("nan"), float("inf")


def test_ties_nan_and_infinities_follow_torch():
    x = torch.tensor([[1.0, NAN, 3.0, NAN], [2.0, 5.0, 5.0, 1.0], [-INF] * 4,
                      [INF, 1.0, INF, 0.0], [0.0, -0.0, 0.0, 0.0]])
    got = row_argmax(x)
    assert got.tolist() == [1, 1, 0, 0, 0] and got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_random_logits_any_shape_and_strides(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 1000, generator=gen).round(decimals=1).to(dtype)  # many ties
    for view in (x, x[:, 1], x.transpose(0, 1), x[..., ::3], x[0, 0]):
        assert torch.equal(row_argmax(view), view.argmax(dim=-1))


def test_inference_mode_tensors():
    with torch.inference_mode():
        x = torch.randn(16, 49152)
        assert torch.equal(row_argmax(x), x.argmax(dim=-1))
