"""``dspark-serve bench serving``: timing arithmetic on a scripted engine, the CLI, and one
tiny real run (default model, plain decoding, with the step profile)."""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import pytest

from dspark_serve.bench import cli, serving
from dspark_serve.bench.serving import CellResult, format_table, run_batch
from dspark_serve.engine.outputs import RequestOutput, SpecStats


class ScriptedEngine:
    """Each step commits ``per_step`` tokens to every request (tau = per_step)."""

    def __init__(self, per_step: int, fast: tuple[str, ...] = (), fast_per_step: int = 0):
        self.per_step, self.fast, self.fast_per_step = per_step, fast, fast_per_step
        self.left: dict[str, int] = {}
        self.budgets: dict[str, int] = {}
        self.most_in_flight = 0
        self.tick = lambda: time.sleep(0.002)

    def add_request(self, request_id, prompt_token_ids, params):
        self.left[request_id] = self.budgets[request_id] = params.max_tokens
        self.most_in_flight = max(self.most_in_flight, len(self.left))

    def has_unfinished(self):
        return bool(self.left)

    def step(self):
        self.tick()
        outs = []
        for rid in list(self.left):
            n = min(self.fast_per_step if rid in self.fast else self.per_step, self.left[rid])
            self.left[rid] -= n
            done = self.left[rid] == 0
            outs.append(RequestOutput(rid, [7] * n, "x" * n, finished=done,
                                      stats=SpecStats(accepted_length=float(self.per_step))))
            if done:
                del self.left[rid]
        return outs

    def pop_step_stats(self):
        return []


def test_run_batch_counts_tokens_and_steps():
    r = run_batch(ScriptedEngine(per_step=3), [[1, 2]] * 4, max_tokens=9, mode="dspark")
    assert (r.mode, r.concurrency, r.output_tokens, r.tau) == ("dspark", 4, 36, 3.0)
    assert 36 / r.wall_s <= r.agg_tok_s < 36 / (3 * 0.002)   # every step ran the whole batch
    assert r.step_ms == pytest.approx(1000 * r.wall_s / 3)  # three steps
    assert 0 < r.ttft_s < r.wall_s and r.user_tok_s > 0


def test_closed_loop_starts_in_steady_state_and_counts_until_the_last_submission(monkeypatch):
    """concurrency 2 over 3 prompts of 9 tokens, each step one second: the first two requests
    get 5 and 9 tokens (staggered, as in a server that has been running). bench-1 (3 tokens a
    step) finishes in step 3 and the last prompt, bench-2, takes its place, so the aggregate
    counts steps 1-3 (bench-0's 1 token a step + bench-1's 3); steps 4-6 are the drain.
    bench-0, cut short, stays out of tok/s/user (it would pull the mean from 4 to 3)."""
    clock = [0.0]
    monkeypatch.setattr(serving, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    engine = ScriptedEngine(per_step=3, fast=("bench-0",), fast_per_step=1)
    engine.tick = lambda: clock.__setitem__(0, clock[0] + 1.0)
    r = run_batch(engine, [[1, 2]] * 3, max_tokens=9, mode="ngram", concurrency=2)
    assert engine.most_in_flight == 2
    assert engine.budgets == {"bench-0": 5, "bench-1": 9, "bench-2": 9}
    assert (r.output_tokens, r.wall_s, r.step_ms) == (23, 6.0, 1000.0)
    assert (r.agg_tok_s, r.user_tok_s, r.ttft_s) == (4.0, 4.0, 1.0)
    with pytest.raises(ValueError, match="concurrency"):
        run_batch(engine, [[1, 2]], max_tokens=9, mode="ngram", concurrency=2)


def test_lockstep_interleaves_steps_and_times_each_loop_by_its_own_steps(monkeypatch):
    """Two engines stepped in turn, one taking 1 s a step and one 2 s: each loop's clock
    counts only its own steps, so each reads as if it had run alone."""
    clock, order = [0.0], []
    monkeypatch.setattr(serving, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    fast, slow = ScriptedEngine(per_step=3), ScriptedEngine(per_step=3)

    def ticker(name, seconds):
        def tick():
            order.append(name)
            clock[0] += seconds
        return tick

    fast.tick, slow.tick = ticker("fast", 1.0), ticker("slow", 2.0)
    res = serving.run_lockstep({
        "fast": serving.closed_loop(fast, [[1]] * 2, max_tokens=6, mode="none"),
        "slow": serving.closed_loop(slow, [[1]] * 2, max_tokens=9, mode="none")})
    assert order == ["fast", "slow", "fast", "slow", "slow"]
    assert (res["fast"].wall_s, res["fast"].agg_tok_s, res["fast"].user_tok_s) == (2.0, 6.0, 5.0)
    assert (res["slow"].wall_s, res["slow"].agg_tok_s, res["slow"].user_tok_s) == (6.0, 3.0, 2.0)


def test_table_lists_every_cell():
    cells = [CellResult("none", 1, 32, 2.0, 16.5, 16.0, 0.1, 0.0, 60.0),
             CellResult("dspark", 16, 512, 4.0, 9.0, 128.0, 0.5, 2.5, 70.0)]
    lines = format_table(cells).splitlines()
    assert lines[0].split() == ["mode", "conc", "tok/s/user", "agg", "tok/s", "TTFT", "s",
                                "tau", "step", "ms"]
    assert lines[1].split() == ["none", "1", "16.5", "16.0", "0.10", "-", "60.0"]
    assert lines[2].split() == ["dspark", "16", "9.0", "128.0", "0.50", "2.50", "70.0"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_defaults_and_bad_values():
    args = _parse(["bench", "serving"])
    assert (args.modes, args.concurrency, args.max_tokens) == (["none", "ngram", "dspark", "hybrid", "dflash"],
                                                               [1, 4, 16], 64)
    with pytest.raises(SystemExit):
        _parse(["bench", "serving", "--concurrency", "0"])
    with pytest.raises(SystemExit):
        _parse(["bench", "serving", "--modes", "eagle"])


@pytest.mark.slow
def test_real_plain_run_with_profile(capsys):
    args = _parse(["bench", "serving", "--modes", "none", "--concurrency", "1", "2",
                   "--max-tokens", "3", "--max-model-len", "256", "--profile", "--json"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    cells = report["results"]
    assert [(c["concurrency"], c["output_tokens"]) for c in cells] == [(1, 3), (2, 6)]
    assert all(c["agg_tok_s"] > 0 and c["user_tok_s"] > 0 for c in cells)
    assert "target forward" in report["profiles"]["none"]
    assert "aten::" in report["profiles"]["none"]
