import pytest
import torch
import torch.nn.functional as F

from dspark_serve.engine.linear import Linear, _can_pack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear(dtype, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    layer = Linear(weight, bias)
    # Float32 always stays on F.linear; bfloat16 packs wherever oneDNN supports it.
    assert layer.packed == (dtype == torch.bfloat16 and _can_pack(weight))
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, 96)
    # Packed bfloat16 rounds like F.linear in bfloat16 (float32 accumulation, one rounding).
    torch.testing.assert_close(out.float(), F.linear(x, weight, bias).float(), atol=0.07,
                               rtol=1e-2)


def test_unpacked_on_request():
    weight = torch.randn(8, 4).bfloat16()
    layer = Linear(weight, pack=False)
    assert not layer.packed and layer.weight is weight
    x = torch.randn(2, 4).bfloat16()
    assert torch.equal(layer(x), F.linear(x, weight))


@pytest.mark.parametrize("shape", [(3072, 576), (49152, 576), (576, 1536)])
def test_packed_bfloat16_rows_do_not_depend_on_row_count(shape):
    """A row's output has the same bits whether it is multiplied alone or among others (the
    batch invariance of the bfloat16 target relies on it). Shapes of SmolLM2-135M's gate/up,
    LM head and down projection; in one oneDNN call of 300 rows the down projection (K =
    1536) changes the last bit of ~6 % of the rows on an AMX CPU."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen).bfloat16()
    if not _can_pack(weight):
        pytest.skip("oneDNN bfloat16 packing unavailable on this CPU")
    layer = Linear(weight)
    x = torch.randn(300, shape[1], generator=gen).bfloat16()
    alone = torch.cat([layer(x[i:i + 1]) for i in range(300)])
    for rows in (2, 17, 100, 300):
        assert torch.equal(layer(x[:rows]), alone[:rows])
