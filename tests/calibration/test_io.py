import pytest
import torch

from dspark_serve.calibration.io import StsCalibration, load_sts_calibration, save_sts_calibration

# What SGLang 0.5.23's DSparkStsCalibration.to_json() writes (msgspec: compact, field order,
# defaults omitted) for a gamma=3 fit.
SGLANG_FILE = ('{"temperatures":[2.5118863582611084,2.2387211322784424,1.0],'
               '"dataset":"/data/sts/shard.*.pt","num_samples":4096,'
               '"ece_before":[0.081,0.062,0.05],"ece_after":[0.011,0.009,0.012]}')


def test_reads_sglang_file_and_writes_it_back_byte_identical(tmp_path):
    path = tmp_path / "calib.json"
    path.write_text(SGLANG_FILE, encoding="utf-8")
    cal = load_sts_calibration(path)
    assert cal.temperatures == [2.5118863582611084, 2.2387211322784424, 1.0]
    assert (cal.dataset, cal.num_samples, cal.gamma) == ("/data/sts/shard.*.pt", 4096, 3)
    assert cal.ece_before == [0.081, 0.062, 0.05] and cal.ece_after == [0.011, 0.009, 0.012]
    assert cal.to_json() == SGLANG_FILE
    t = cal.temperatures_for(3)
    assert t.dtype == torch.float32 and t.tolist() == pytest.approx(cal.temperatures)


def test_round_trip(tmp_path):
    cal = StsCalibration(temperatures=[1.7, 2.25], dataset="alpaca, serving T=0.7 é",
                         num_samples=123, ece_before=[0.05, 0.07], ece_after=[0.01, 0.012])
    path = save_sts_calibration(tmp_path / "nested" / "calib.json", cal)
    assert load_sts_calibration(path) == cal
    assert "é" in path.read_text(encoding="utf-8")  # UTF-8 like msgspec, not \\u escapes


def test_defaults_omitted_ints_accepted_unknown_keys_ignored():
    assert StsCalibration(temperatures=[1, 2]).to_json() == '{"temperatures":[1.0,2.0]}'
    cal = StsCalibration.from_json('{"temperatures":[1,2],"future_field":{"x":1}}')
    assert cal == StsCalibration(temperatures=[1.0, 2.0])
    assert cal.dataset == "" and cal.num_samples == 0 and cal.ece_before == [] and cal.ece_after == []


@pytest.mark.parametrize("text, exc", [
    ('{"temperatures":[]}', ValueError),
    ('{"temperatures":[1.0,0.0]}', ValueError),
    ('{"temperatures":[1.0,-0.5]}', ValueError),
    ('{"temperatures":[1.0,NaN]}', ValueError),
    ('{"dataset":"x"}', ValueError),
    ('{"temperatures":[true]}', TypeError),
    ('{"temperatures":"1.0"}', TypeError),
    ('{"temperatures":[1.0],"num_samples":1.5}', TypeError),
    ('{"temperatures":[1.0],"num_samples":-1}', ValueError),
    ('{"temperatures":[1.0],"ece_before":[0.1,0.2]}', ValueError),
    ('[1.0]', TypeError),
    ('{"temperatures":[1.0]', ValueError),
])
def test_bad_files_rejected(text, exc):
    with pytest.raises(exc):
        StsCalibration.from_json(text)


def test_gamma_mismatch_and_unwritable_values():
    cal = StsCalibration(temperatures=[1.0, 2.0, 3.0])
    assert cal.temperatures_for(2).tolist() == [1.0, 2.0]  # a shorter block: same positions
    with pytest.raises(ValueError, match="gamma=3"):
        cal.temperatures_for(5)
    with pytest.raises(ValueError, match="gamma=3"):
        cal.temperatures_for(0)
    with pytest.raises(ValueError):
        StsCalibration(temperatures=[1.0], ece_after=[float("nan")])
