"""CostTable: SGLang SpsCostTable JSON compatibility, lookup rule, validation."""
import json

import pytest
import torch

from dspark_serve.scheduling import CostTable

# What SGLang 0.5.23's SpsCostTable.to_json() writes (msgspec: compact, fields in order).
SGLANG_JSON = ('{"sample_batch_tokens":[1,4,16],"sample_steps_per_sec":[10.0,9.0,5.0],'
               '"max_batch_tokens":64}')


def table() -> CostTable:
    return CostTable.from_json(SGLANG_JSON)


def test_reads_sglang_file(tmp_path):
    path = tmp_path / "sps.json"
    path.write_text(SGLANG_JSON)
    loaded = CostTable.load(path)
    assert loaded.sample_batch_tokens == (1, 4, 16)
    assert loaded.sample_steps_per_sec == (10.0, 9.0, 5.0)
    assert loaded.max_batch_tokens == 64
    assert loaded.meta == {}


def test_writes_sglang_bytes_without_meta(tmp_path):
    path = tmp_path / "sps.json"
    table().save(path)
    assert path.read_text() == SGLANG_JSON


def test_round_trip_with_meta(tmp_path):
    meta = {"device": "NVIDIA H200", "date": "2026-11-29", "model": "SmolLM2-135M", "repeats": 5}
    original = CostTable((1, 2, 8), (66.0, 50.5, 12.25), 32, meta)
    path = tmp_path / "sps.json"
    original.save(path)
    text = path.read_text()
    assert text.startswith('{"sample_batch_tokens":[1,2,8],"sample_steps_per_sec":[66.0,50.5,'
                           '12.25],"max_batch_tokens":32,"meta":{')
    assert CostTable.load(path) == original


def test_reading_accepts_int_sps_and_ignores_unknown_keys():
    text = json.dumps({"sample_batch_tokens": [2, 3], "sample_steps_per_sec": [7, 6],
                       "max_batch_tokens": 3, "future_key": [1]})
    loaded = CostTable.from_json(text)
    assert loaded.sample_steps_per_sec == (7.0, 6.0)
    assert loaded.max_batch_tokens == 3


def test_from_step_times():
    t = CostTable.from_step_times([1, 4], [0.5, 0.25])
    assert t.sample_steps_per_sec == (2.0, 4.0)
    assert t.max_batch_tokens == 4


@pytest.mark.parametrize("batch, expected", [
    (1, 10.0),       # at the first probe
    (2, 9.0),        # between probes: the probe above (SGLang would give 10.0)
    (4, 9.0),        # at a probe
    (5, 5.0),
    (16, 5.0),
    (32, 2.5),       # beyond the last probe: step time grows in proportion to B
    (64, 1.25),      # at max_batch_tokens: still feasible
    (65, 0.0),       # infeasible
])
def test_lookup(batch, expected):
    assert table().sps(torch.tensor([batch])).tolist() == [expected]


def test_lookup_below_first_probe_uses_first_probe():
    t = CostTable((4, 8), (3.0, 2.0), 8)
    assert t.sps(torch.tensor([[1, 3], [4, 9]])).tolist() == [[3.0, 3.0], [3.0, 0.0]]


def test_sps_range_matches_sps():
    t = table()
    for start, stop in [(1, 2), (1, 70), (3, 17), (60, 80), (65, 90), (100, 100)]:
        expected = t.sps(torch.arange(start, stop)) if stop > start else torch.zeros(0)
        got = t.sps_range(start, stop)
        assert got.dtype == torch.float64
        assert torch.equal(got, expected.double())


@pytest.mark.parametrize("kwargs, message", [
    (dict(sample_batch_tokens=(), sample_steps_per_sec=()), "at least one probe"),
    (dict(sample_batch_tokens=(1, 4), sample_steps_per_sec=(1.0,)), "differ in length"),
    (dict(sample_batch_tokens=(4, 1), sample_steps_per_sec=(1.0, 1.0)), "strictly increasing"),
    (dict(sample_batch_tokens=(1, 1), sample_steps_per_sec=(1.0, 1.0)), "strictly increasing"),
    (dict(sample_batch_tokens=(0, 1), sample_steps_per_sec=(1.0, 1.0)), ">= 1"),
    (dict(sample_batch_tokens=(1, 2), sample_steps_per_sec=(1.0, 0.0)), "finite and > 0"),
    (dict(sample_batch_tokens=(1, 2), sample_steps_per_sec=(1.0, -2.0)), "finite and > 0"),
    (dict(sample_batch_tokens=(1, 2), sample_steps_per_sec=(1.0, float("nan"))), "finite"),
    (dict(sample_batch_tokens=(1, 8), sample_steps_per_sec=(1.0, 1.0), max_batch_tokens=4),
     "max_batch_tokens must be >= the largest probe"),
])
def test_invalid_tables(kwargs, message):
    kwargs.setdefault("max_batch_tokens", 64)
    with pytest.raises(ValueError, match=message):
        CostTable(**kwargs)


@pytest.mark.parametrize("text, message", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "must be an object"),
    ('{"sample_batch_tokens":[1],"sample_steps_per_sec":[1.0]}', "missing required keys"),
    ('{"sample_batch_tokens":[1.0],"sample_steps_per_sec":[1.0],"max_batch_tokens":1}',
     "must be an int"),
    ('{"sample_batch_tokens":[1],"sample_steps_per_sec":[true],"max_batch_tokens":1}',
     "must be a number"),
    ('{"sample_batch_tokens":1,"sample_steps_per_sec":[1.0],"max_batch_tokens":1}',
     "must be a JSON list"),
    ('{"sample_batch_tokens":[1],"sample_steps_per_sec":[1.0],"max_batch_tokens":1,"meta":3}',
     "meta must be a dict"),
    ('{"bias_seconds":0.01,"bs_probes":[1],"alpha_seconds":[0.0],"m_probes":[1],'
     '"theta_seconds":[0.0]}', "SpsAdditiveCostTable"),
])
def test_invalid_json(text, message):
    with pytest.raises(ValueError, match=message):
        CostTable.from_json(text)


def test_meta_that_sglang_would_misread_is_refused():
    t = CostTable((1,), (1.0,), 1, {"bias_seconds": 0.01})
    with pytest.raises(ValueError, match="SpsAdditiveCostTable"):
        t.to_json()
    with pytest.raises(ValueError, match="JSON-serialisable"):
        CostTable((1,), (1.0,), 1, {"x": object()}).to_json()


def test_sps_input_errors():
    with pytest.raises(TypeError, match="int64"):
        table().sps(torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match=">= 1"):
        table().sps(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="start"):
        table().sps_range(0, 3)
