"""Prometheus exporter: exact values from hand-made step stats, and end to end via /metrics."""
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark_serve.engine.outputs import StepStats
from dspark_serve.server.metrics import ServerMetrics


def samples(text: str) -> dict:
    """{(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_observe_exact_values():
    m = ServerMetrics()
    m.observe([StepStats(num_running=3, num_waiting=1, verify_tokens=12, drafted_tokens=12,
                         accepted_tokens=5, accepted_per_position=[3, 2, 0, 0],
                         verified_per_position=[3, 3, 2, 1], rounds=3, generated_tokens=8,
                         step_seconds=0.05),
               StepStats(num_running=2, num_waiting=0, verify_tokens=6, drafted_tokens=8,
                         accepted_tokens=4, accepted_per_position=[2, 2, 0, 0],
                         verified_per_position=[2, 2, 0, 0], rounds=2, generated_tokens=6,
                         step_seconds=0.03),
               StepStats(num_running=1, generated_tokens=1, step_seconds=0.01)],  # plain step
              kv_free_tokens=1234)
    s = samples(m.render().decode())
    assert s[("dspark_drafted_tokens_total", ())] == 20
    assert s[("dspark_accepted_tokens_total", ())] == 9
    assert s[("dspark_verify_rounds_total", ())] == 5
    assert s[("dspark_generated_tokens_total", ())] == 15
    assert [s[("dspark_position_accepted_total", (("position", str(k)),))] for k in (1, 2, 3, 4)] \
        == [5, 4, 0, 0]
    assert [s[("dspark_position_verified_total", (("position", str(k)),))] for k in (1, 2, 3, 4)] \
        == [5, 5, 2, 1]
    # verify budget histogram: only steps that verified (B = 12 and 6)
    assert s[("dspark_verify_tokens_per_step_count", ())] == 2
    assert s[("dspark_verify_tokens_per_step_sum", ())] == 18
    assert s[("dspark_verify_tokens_per_step_bucket", (("le", "8.0"),))] == 1
    assert s[("dspark_step_seconds_count", ())] == 3
    assert s[("dspark_step_seconds_sum", ())] == pytest.approx(0.09)
    assert s[("dspark_num_requests_running", ())] == 1
    assert s[("dspark_num_requests_waiting", ())] == 0
    assert s[("dspark_kv_free_tokens", ())] == 1234
    assert s[("dspark_mean_accepted_length", ())] == pytest.approx((9 + 5) / 5)
    assert s[("dspark_generation_tokens_per_second", ())] == pytest.approx(15 / 10)


def test_no_rounds_yet():
    m = ServerMetrics()
    assert m.mean_accepted_length() == 0.0 and m.tokens_per_second() == 0.0


def test_metrics_endpoint_matches_responses(make_fake_engine, serve_engine, wait_for):
    engine = make_fake_engine()
    with serve_engine(engine) as (url, app):
        with httpx.Client(base_url=url, timeout=20) as c:
            bodies = [c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 30, "seed": s,
                                                      "ignore_eos": True, "n": 2}).json()
                      for s in range(3)]
            assert wait_for(lambda: app.state.async_engine.num_in_flight == 0)
            r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = samples(r.text)
    rounds = sum(b["dspark"]["verify_rounds"] for b in bodies)
    accepted = sum(b["dspark"]["accepted_tokens"] for b in bodies)
    assert s[("dspark_generated_tokens_total", ())] == 6 * 30
    assert s[("dspark_verify_rounds_total", ())] == rounds == 6 * 15
    assert s[("dspark_accepted_tokens_total", ())] == accepted
    assert s[("dspark_drafted_tokens_total", ())] == 4 * rounds
    assert s[("dspark_mean_accepted_length", ())] == pytest.approx((accepted + rounds) / rounds)
    assert s[("dspark_requests_finished_total", (("finish_reason", "length"),))] == 6
    assert s[("dspark_kv_free_tokens", ())] == engine.KV_TOKENS
