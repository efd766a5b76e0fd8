"""Run summaries from records + window, exact on hand-made inputs."""
from __future__ import annotations

import pytest

from dspark_serve.loadtest.summary import SUMMARY_FIELDS, failed_row, summarize


def _rec(t_start, t_end, tokens, tok_s_user, ttft, ok=True, rounds=None, accepted=None):
    return {"ok": ok, "t_start": t_start, "t_end": t_end, "completion_tokens": tokens,
            "tok_s_user": tok_s_user, "tpot_s": 1 / tok_s_user if tok_s_user else None,
            "ttft_s": ttft, "e2e_s": t_end - t_start, "verify_rounds": rounds,
            "accepted_tokens": accepted}


RECORDS = [
    _rec(10.0, 12.0, 20, 10.0, 0.2, rounds=8, accepted=12),
    _rec(11.0, 15.0, 40, 20.0, 0.4, rounds=10, accepted=30),
    _rec(12.0, 19.0, 30, 30.0, 0.6, rounds=12, accepted=18),
    _rec(13.0, 13.5, 0, None, None, ok=False),
]


def test_with_server_metrics():
    window = {"t_start": 10.0, "t_end": 20.0,
              "metrics_delta": {"generated_tokens": 150.0, "verify_rounds": 40.0,
                                "verify_tokens": 140.0}}
    row = summarize(RECORDS, window, config="dspark", concurrency=4)
    assert set(row) == set(SUMMARY_FIELDS)
    assert row["aggregate_tok_s"] == pytest.approx(15.0)             # 150 tokens / 10 s
    assert (row["requests_ok"], row["requests_failed"]) == (3, 1)
    assert row["median_tok_s_user"] == pytest.approx(20.0)
    assert row["p10_tok_s_user"] == pytest.approx(12.0)              # 10 + 0.2 * (20 - 10)
    assert row["p90_tok_s_user"] == pytest.approx(28.0)
    assert row["median_ttft_s"] == pytest.approx(0.4)
    assert row["median_tpot_s"] == pytest.approx(0.05)
    assert row["mean_completion_tokens"] == pytest.approx(30.0)
    assert row["mean_concurrency"] == pytest.approx((2 + 4 + 7 + 0.5) / 10)
    assert row["accepted_length"] == pytest.approx((60 + 30) / 30)  # (accepted + rounds) / rounds
    assert row["verify_budget_per_request"] == pytest.approx(3.5)
    assert row["status"] == "ok"


def test_locust_in_flight_count_wins():
    window = {"t_start": 10.0, "t_end": 20.0, "mean_in_flight": 3.25}
    assert summarize(RECORDS, window, config="x", concurrency=4)["mean_concurrency"] == 3.25


def test_client_side_fallback():
    # no /metrics: tokens of successful requests ending inside the window (t_end 19 is out)
    row = summarize(RECORDS, {"t_start": 10.0, "t_end": 16.0}, config="x", concurrency=1)
    assert row["aggregate_tok_s"] == pytest.approx((20 + 40) / 6)
    assert row["verify_budget_per_request"] is None


def test_bad_window_and_failed_row():
    with pytest.raises(ValueError):
        summarize(RECORDS, {"t_start": 5.0}, config="x", concurrency=1)
    row = failed_row("none", 8, "server_failed")
    assert row["status"] == "server_failed" and row["aggregate_tok_s"] is None
    assert set(row) == set(SUMMARY_FIELDS)
