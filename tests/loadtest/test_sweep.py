"""The sweep runner end to end against fake-engine servers: a fresh loopback server per run,
summary CSV/JSON, per-request CSV, figures; a server that cannot start is recorded, not
fatal; the time budget skips runs it cannot fit."""
from __future__ import annotations

import csv
import json
import sys

import pytest

from loadtest.cli import main
from loadtest.sweep import SweepOptions, run_sweep


def test_sweep_end_to_end(tmp_path, fake_server_cmd):
    code = main(["sweep", "--out", str(tmp_path), "--configs", "none,dspark",
                 "--concurrency", "2", "--run-time", "3", "--time-budget", "200",
                 "--server-cmd", " ".join(fake_server_cmd), "--prompt-sets", "mtbench,sharegpt",
                 "--max-prompt-chars", "150", "--max-tokens", "24", "--think-time", "0.05"])
    assert code == 0
    with open(tmp_path / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["config"], r["concurrency"], r["status"]) for r in rows] == \
        [("none", "2", "ok"), ("dspark", "2", "ok")]
    for r in rows:
        assert int(r["requests_ok"]) >= 5 and int(r["requests_failed"]) == 0
        assert float(r["aggregate_tok_s"]) > 0 and float(r["median_tok_s_user"]) > 0
        assert float(r["verify_budget_per_request"]) == 5.0  # fake engine: gamma + 1
    meta = json.loads((tmp_path / "summary.json").read_text())["meta"]
    assert meta["options"]["configs"] == ["none", "dspark"]
    with open(tmp_path / "requests.csv", newline="") as f:
        requests = list(csv.DictReader(f))
    assert {r["config"] for r in requests} == {"none", "dspark"}
    assert len(requests) == sum(int(r["requests_ok"]) for r in rows)
    log = (tmp_path / "runs" / "none-c2" / "server.log").read_text()
    assert "serve --speculative none --host 127.0.0.1 --port" in log
    assert (tmp_path / "pareto.png").stat().st_size > 0 and (tmp_path / "load.png").exists()


def test_server_failure_recorded(tmp_path):
    opts = SweepOptions(out_dir=tmp_path, configs=["none"], concurrency=[1], run_time_s=3,
                        server_cmd=[sys.executable, "-c", "import sys; sys.exit(3)"])
    assert [r["status"] for r in run_sweep(opts)] == ["server_failed"]
    log = (tmp_path / "runs" / "none-c1" / "server.log").read_text()
    assert log.startswith("$ ") and " serve --speculative none --host 127.0.0.1" in log


def test_budget_skips_runs(tmp_path):
    opts = SweepOptions(out_dir=tmp_path, configs=["none", "dspark"], concurrency=[1, 2],
                        time_budget_s=30.0, server_cmd=[sys.executable, "-c", "pass"])
    # 20 s of the budget per run is overhead before any is measured: nothing fits
    assert [r["status"] for r in run_sweep(opts)] == ["skipped_budget"] * 4


@pytest.mark.parametrize("kwargs", [{"configs": ["turbo"]}, {"concurrency": [0]},
                                    {"run_time_s": 1}, {"time_budget_s": 0}])
def test_bad_options(tmp_path, kwargs):
    with pytest.raises(ValueError):
        SweepOptions(out_dir=tmp_path, **kwargs)
