"""SPS(B) grid, timing (on a fake clock, so medians are exact), cost table and files."""
from __future__ import annotations

import matplotlib.image
import pytest
import torch

from dspark_serve.scheduling.cost_table import CostTable
from dspark_serve.profiling import sps as sps_module
from dspark_serve.profiler.device import device_metadata, device_sku, sanitize
from dspark_serve.profiler.report import write_profile
from dspark_serve.profiling.sps import SpsProfile, batch_grid, cost_table_from_profile, profile_sps


@pytest.mark.parametrize("max_b,per_octave,expected", [
    (16, 4, [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]),
    (20, 2, [1, 2, 3, 4, 6, 8, 12, 16, 20]),
    (100, 1, [1, 2, 4, 8, 16, 32, 64, 100]),
    (1, 4, [1]),
    (40, 4, [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40]),
])
def test_batch_grid(max_b, per_octave, expected):
    assert batch_grid(max_b, per_octave) == expected


@pytest.mark.parametrize("args", [(0,), (16, 0), (2.0,), (True,)])
def test_batch_grid_rejects(args):
    with pytest.raises(ValueError):
        batch_grid(*args)


class FakeClock:
    """perf_counter replacement; the fake step advances it by a known step time."""

    def __init__(self):
        self.now = 0.0
        self.calls = []
        self.syncs = 0

    def step_time(self, b, c):
        return 0.001 * (1 + b) + 1e-5 * c

    def step(self, b, c):
        self.calls.append((b, c))
        # every 3rd call of a probe is an outlier the median must ignore
        slow = 0.5 if self.calls.count((b, c)) % 3 == 0 else 0.0
        self.now += self.step_time(b, c) + slow

    def sync(self):
        self.syncs += 1


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(sps_module.time, "perf_counter", lambda: c.now)
    return c


def test_profile_medians_and_order(clock):
    prof = profile_sps(clock.step, [1, 2, 4], [64, 16], warmup=1, repeats=5, sync=clock.sync,
                       progress=False)
    assert prof.batch_tokens == (1, 2, 4) and prof.context_lens == (16, 64)
    probes = [(b, c) for b in (1, 2, 4) for c in (16, 64)]
    # first round: warm-up + one timed call per probe; then 4 rounds over every probe, B
    # descending (B = 1 never right after the largest B), each timed call after an untimed one
    # of the same probe
    later = [p for b in (4, 2, 1) for p in [(b, 16), (b, 16), (b, 64), (b, 64)]]
    assert clock.calls == [p for p in probes for _ in range(2)] + later * 4
    assert clock.syncs == len(clock.calls)
    for c in (16, 64):
        assert prof.step_seconds[c] == pytest.approx([clock.step_time(b, c) for b in (1, 2, 4)])
    assert prof.steps_per_sec(16)[0] == pytest.approx(1 / clock.step_time(1, 16))


def test_slow_period_spreads_over_all_probes(monkeypatch):
    """A slow period as long as one probe's repeats inflates no probe's median."""
    c = FakeClock()
    monkeypatch.setattr(sps_module.time, "perf_counter", lambda: c.now)

    def step(b, ctx):
        c.calls.append((b, ctx))
        c.now += c.step_time(b, ctx) * (3.0 if 4 <= len(c.calls) <= 6 else 1.0)

    prof = profile_sps(step, [1, 2, 4], [0], warmup=0, repeats=3, progress=False)
    assert prof.step_seconds[0] == pytest.approx([c.step_time(b, 0) for b in (1, 2, 4)])


def test_time_budget_stops_growing_b(clock):
    # the first round (warm-up + 1 timed call per probe: 2 ms each at B = 1, 3 ms at B = 2)
    # gets 0.014 / 2 s: it runs out during B = 2
    prof = profile_sps(clock.step, [1, 2, 4, 8], [0], warmup=1, repeats=2, time_budget_s=0.014,
                       progress=False)
    assert prof.batch_tokens == (1, 2)
    assert len(prof.step_seconds[0]) == 2
    assert clock.calls == [(1, 0), (1, 0), (2, 0), (2, 0), (2, 0), (2, 0), (1, 0), (1, 0)]


@pytest.mark.parametrize("kwargs", [
    dict(batch_tokens=[], context_lens=[0]), dict(batch_tokens=[2, 1], context_lens=[0]),
    dict(batch_tokens=[0, 1], context_lens=[0]), dict(batch_tokens=[1], context_lens=[-1]),
    dict(batch_tokens=[1], context_lens=[0], repeats=0),
])
def test_profile_rejects(kwargs):
    with pytest.raises(ValueError):
        profile_sps(lambda b, c: None, progress=False, **kwargs)


PROFILE = SpsProfile((1, 2, 4), (128, 512), {128: (0.010, 0.011, 0.020),
                                             512: (0.012, 0.013, 0.025)}, warmup=2, repeats=5)


def test_cost_table_from_profile():
    table = cost_table_from_profile(PROFILE, meta={"sku": "X"})
    assert table.sample_batch_tokens == (1, 2, 4)
    assert table.sample_steps_per_sec == pytest.approx((1 / 0.012, 1 / 0.013, 1 / 0.025))
    assert table.max_batch_tokens == 4 and table.meta["context_len"] == 512
    assert SpsProfile.from_meta(table.meta["profile"]) == PROFILE
    short = cost_table_from_profile(PROFILE, context_len=128, max_batch_tokens=64)
    assert short.sample_steps_per_sec[2] == pytest.approx(50.0)
    assert short.max_batch_tokens == 64
    # past the last probe the table extrapolates step time in proportion to B
    assert float(short.sps(torch.tensor([8]))) == pytest.approx(25.0)
    with pytest.raises(ValueError, match="not profiled"):
        cost_table_from_profile(PROFILE, context_len=256)


def test_write_profile(tmp_path):
    meta = device_metadata("cpu", model="tiny")
    json_path, png_path = write_profile(PROFILE, tmp_path / "out", meta=meta)
    assert json_path == tmp_path / "out" / f"{meta['sku']}.json"
    table = CostTable.load(json_path)
    assert table == cost_table_from_profile(PROFILE, meta=meta)
    assert table.meta["model"] == "tiny" and table.meta["torch"] == torch.__version__
    assert matplotlib.image.imread(png_path).shape[:2] == (504, 1320)  # 11 x 4.2 in, 120 dpi
    assert write_profile(PROFILE, tmp_path / "np", meta=meta, plot=False)[1] is None
    with pytest.raises(ValueError, match="sku"):
        write_profile(PROFILE, tmp_path, meta={})


def test_device_names():
    assert sanitize("NVIDIA H200") == "NVIDIA_H200"
    assert sanitize("Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.10GHz") == "Intel_Xeon_Platinum_8480"
    assert sanitize("AMD EPYC 9654 96-Core Processor") == "AMD_EPYC_9654_96_Core_Processor"
    sku = device_sku("cpu")
    assert sku.endswith(f"_{torch.get_num_threads()}c") and " " not in sku
    meta = device_metadata("cpu", model="m")
    assert {"device", "sku", "torch", "cuda", "date", "model", "cpu_threads"} <= set(meta)
