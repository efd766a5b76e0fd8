"""The Locust file, headless for a few seconds against a live server on loopback: requests
succeed, per-request records and the /metrics window are written; remote hosts are refused."""
from __future__ import annotations

import csv
import json
import subprocess

from dspark_serve.loadtest.records import read_records
from dspark_serve.loadtest.server import ManagedServer
from dspark_serve.loadtest.sweep import SweepOptions, locust_command

# prompts the fake engine (character tokens, 256-token context) can take
SMALL = dict(prompt_sets="mtbench,sharegpt", max_prompt_chars=150, max_tokens=32, min_tokens=4,
             think_time_s=0.05)


def test_headless_run_records_requests(tmp_path, fake_server_cmd):
    opts = SweepOptions(out_dir=tmp_path, **SMALL)
    with ManagedServer(["--speculative", "dspark"], tmp_path / "server.log",
                       server_cmd=fake_server_cmd) as server:
        proc = subprocess.run(locust_command(opts, server.url, 4, 4, tmp_path),
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_records(tmp_path / "requests.jsonl")
    assert len(records) >= 10
    assert all(r["ok"] for r in records), [r["error"] for r in records if not r["ok"]]
    assert {r["prompt_set"] for r in records} <= {"mtbench", "sharegpt"}
    for r in records:
        assert 1 <= r["completion_tokens"] <= r["max_tokens"] <= 32
        assert r["e2e_s"] > 0 and r["finish_reason"] in ("stop", "length")
        # the fake engine reports gamma = 4 drafts per verify round
        assert r["verify_rounds"] >= 1 and r["drafted_tokens"] == 4 * r["verify_rounds"]
        assert r["accepted_length"] == (r["accepted_tokens"] + r["verify_rounds"]) / \
            r["verify_rounds"]
    timed = [r for r in records if r["tok_s_user"] is not None]
    assert len(timed) >= 5
    assert all(0 < r["ttft_s"] < r["e2e_s"] for r in timed)
    assert all(abs(r["tok_s_user"] * r["tpot_s"] - 1) < 1e-9 for r in timed)
    window = json.loads((tmp_path / "window.json").read_text())
    assert window["t_end"] > window["t_start"]
    t0, t1 = window["t_start"], window["t_end"]
    finished = sum(max(0.0, min(r["t_end"], t1) - max(r["t_start"], t0)) for r in records)
    # Little's law over the window: at least the finished requests' share, at most 4 users
    assert 1.0 < finished / (t1 - t0) <= window["mean_in_flight"] + 1e-9
    assert window["mean_in_flight"] <= 4.0
    delta = window["metrics_delta"]
    assert delta["generated_tokens"] > 0 and delta["verify_rounds"] > 0
    assert delta["verify_tokens"] == 5 * delta["verify_rounds"]  # fake: gamma + 1 per round
    with open(tmp_path / "locust_stats.csv", newline="") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    # Locust's CSV is flushed periodically, so it may lag the last second of the run
    assert 0 < int(stats["chat/completions"]["Request Count"]) <= len(records)
    assert int(stats["chat/completions"]["Failure Count"]) == 0
    assert 0 < int(stats["ttft"]["Request Count"]) <= len(timed)


def test_max_requests_bound(tmp_path, fake_server_cmd):
    opts = SweepOptions(out_dir=tmp_path, max_requests=6, **SMALL)
    with ManagedServer([], tmp_path / "server.log", server_cmd=fake_server_cmd) as server:
        proc = subprocess.run(locust_command(opts, server.url, 3, 60, tmp_path),
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_records(tmp_path / "requests.jsonl")) == 6  # long before the 60 s limit


def test_refuses_remote_host(tmp_path):
    opts = SweepOptions(out_dir=tmp_path, **SMALL)
    # TEST-NET-1 address: never contacted, the Locust file refuses it before any request
    proc = subprocess.run(locust_command(opts, "http://192.0.2.1:9", 1, 5, tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "refusing non-loopback host" in proc.stderr
    assert not (tmp_path / "requests.jsonl").exists()
