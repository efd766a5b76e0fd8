"""Philox4x32-10 streams: Random123 known answers and the documented uniform layout."""
import pytest
import torch

from dspark_serve.ops.philox import philox4x32_10, philox_uniforms

# Random123 known-answer vectors (counter, key, output) for Philox4x32-10.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _philox_scalar(counter, key):
    """Plain-integer Philox4x32-10, one block at a time."""
    c, (k0, k1) = list(counter), key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_known_answers(counter, key, expected):
    out = philox4x32_10(torch.tensor([counter]), torch.tensor([key]))
    assert out[0].tolist() == list(expected)
    assert _philox_scalar(counter, key) == list(expected)


def test_uniform_layout_matches_definition():
    seeds = [0, 1, -5, 2**62 + 12345]
    offsets = [0, 7, 2**33 + 3, 2**63 - 2]
    n = 11
    got = philox_uniforms(torch.tensor(seeds), torch.tensor(offsets), n)
    assert got.shape == (4, n) and got.dtype == torch.float32
    for r, (seed, offset) in enumerate(zip(seeds, offsets)):
        s = seed % 2**64
        for i in range(n):
            c = (offset + i // 4) % 2**64
            word = _philox_scalar((c & 0xFFFFFFFF, c >> 32, 0, 0), (s & 0xFFFFFFFF, s >> 32))[i % 4]
            assert got[r, i].item() == (word >> 8) / 2**24


def test_offset_advances_by_blocks_of_four():
    seed = torch.tensor([3, 4])
    a = philox_uniforms(seed, torch.tensor([10, 20]), 12)
    b = philox_uniforms(seed, torch.tensor([11, 21]), 8)
    assert torch.equal(a[:, 4:], b)


def test_range_and_moments():
    u = philox_uniforms(torch.arange(8), torch.zeros(8, dtype=torch.int64), 4096)
    assert bool((u >= 0).all()) and bool((u < 1).all())
    # Mean of 32768 uniforms: standard error 0.0016, bound at ~6 sigma.
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.003
    assert not torch.equal(u[0], u[1])


def test_bad_arguments():
    with pytest.raises(ValueError, match="int64"):
        philox_uniforms(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="n must be"):
        philox_uniforms(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), -1)
