"""The sweep runner end to end against fake-engine servers: a fresh loopback server per run,
summary CSV/JSON, per-request CSV, figures; a server that cannot start is recorded, not
fatal; the time budget skips runs it cannot fit."""
from __future__ import annotations

import csv
import json
import sys

import pytest

from dspark_serve.bench import compare
from dspark_serve.loadtest import sweep
from dspark_serve.loadtest.cli import main
from dspark_serve.loadtest.summary import failed_row
from dspark_serve.loadtest.sweep import SweepOptions, locust_command, run_sweep


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


def test_llama_config_without_its_server_is_skipped_up_front(tmp_path, monkeypatch):
    """Five failed server starts before: llama-cpp-python without its [server] extra."""
    monkeypatch.setattr(sweep, "llama_server_unavailable", lambda: "no server extra")
    opts = SweepOptions(out_dir=tmp_path, configs=["llama.cpp"], concurrency=[1, 2],
                        server_cmd=[sys.executable, "-c", "raise SystemExit(3)"])
    assert [(r["config"], r["concurrency"], r["status"]) for r in run_sweep(opts)] == \
        [("llama.cpp", 1, "skipped_unavailable"), ("llama.cpp", 2, "skipped_unavailable")]
    assert not (tmp_path / "runs").exists()


def test_llama_server_unavailable_names_the_missing_extra(monkeypatch):
    monkeypatch.setattr(compare, "llama_unavailable", lambda: None)
    monkeypatch.setitem(sys.modules, "llama_cpp.server.app", None)   # import raises
    reason = sweep.llama_server_unavailable()
    assert reason.startswith("llama-cpp-python's server cannot start (")
    assert reason.endswith("pip install 'dspark-serve[bench]' (llama-cpp-python[server])")
    monkeypatch.setattr(compare, "llama_unavailable", lambda: "not installed")
    assert sweep.llama_server_unavailable() == "not installed"


@pytest.mark.parametrize("kwargs", [{"configs": ["turbo"]}, {"concurrency": [0]},
                                    {"run_time_s": 1}, {"time_budget_s": 0}])
def test_bad_options(tmp_path, kwargs):
    with pytest.raises(ValueError):
        SweepOptions(out_dir=tmp_path, **kwargs)


def test_budget_split(tmp_path, monkeypatch):
    """Each run gets an equal share of what is left: the largest measured overhead off, then
    two thirds measured run (capped by run_time_s) and the rest tail (capped at 30 s)."""
    calls = []

    def fake_run_one(opts, config, users, run_time, tail):
        calls.append((config, users, run_time, tail))
        return failed_row(config, users, "fake"), [], 17.0

    monkeypatch.setattr(sweep, "run_one", fake_run_one)
    opts = SweepOptions(out_dir=tmp_path, configs=["none", "dspark"], concurrency=[1, 2, 4],
                        run_time_s=200, time_budget_s=610.5)
    sweep.run_sweep(opts)
    # 600.5 s after the plot reserve: run 1 guesses 20 s overhead, 100.1 - 20 - 3 = 77.1 s for
    # Locust -> 51 + 26; later runs use the measured 17 s: 120.1 - 17 - 3 = 100.1 -> 66 + 30
    # (the cap); the 0.5 s keeps the floors clear of the microseconds the loop itself takes
    assert calls[0] == ("none", 1, 51, 26)
    assert calls[1] == ("none", 2, 66, 30)
    assert [c[:2] for c in calls] == [(c, u) for c in ("none", "dspark") for u in (1, 2, 4)]
    capped = SweepOptions(out_dir=tmp_path, configs=["none"], concurrency=[1], run_time_s=20,
                          time_budget_s=610.5)
    calls.clear()
    sweep.run_sweep(capped)
    assert calls == [("none", 1, 20, 30)]


def test_locust_command_bounds(tmp_path):
    opts = SweepOptions(out_dir=tmp_path, max_requests=50)
    cmd = locust_command(opts, "http://127.0.0.1:1", 8, 25, tmp_path, tail_s=12)
    flags = dict(zip(cmd, cmd[1:]))
    assert (flags["-u"], flags["-t"], flags["--stop-timeout"], flags["--max-requests"]) == \
        ("8", "25s", "12", "50")
    assert flags["-H"] == "http://127.0.0.1:1" and "--headless" in cmd


def test_llama_cpp_configs_start_its_openai_server(tmp_path, monkeypatch):
    """llama.cpp configurations run ``python -m llama_cpp.server`` on the default model's GGUF
    file, with serve's default thread count, healthy at /v1/models; ours run ``serve``."""
    import dspark_serve.assets.default_model as default_model

    monkeypatch.setattr(default_model, "default_gguf_path", lambda: "/m/SmolLM2.gguf")
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 4)
    opts = SweepOptions(out_dir=tmp_path, configs=["llama.cpp-lookup", "hybrid"])
    llama = sweep._server(opts, "llama.cpp-lookup", tmp_path / "a.log")
    assert llama.cmd[:3] == [sys.executable, "-m", "llama_cpp.server"]
    args = llama.cmd[3:]
    for flag, value in (("--model", "/m/SmolLM2.gguf"), ("--n_threads", "3"),
                        ("--draft_model", "prompt-lookup-decoding"), ("--model_alias", "default")):
        assert args[args.index(flag) + 1] == value
    assert "serve" not in args and llama.health_path == "/v1/models"
    ours = sweep._server(opts, "hybrid", tmp_path / "b.log")
    assert ours.cmd[3:6] == ["serve", "--speculative", "hybrid"] and ours.health_path == "/health"
