"""``dspark-serve bench serving``: timing arithmetic on a scripted engine, the CLI, and one
tiny real run (default model, plain decoding, with the step profile)."""
from __future__ import annotations

import argparse
import json
import time

import pytest

from dspark_serve.bench import cli
from dspark_serve.bench.serving import CellResult, format_table, run_batch
from dspark_serve.engine.outputs import RequestOutput, SpecStats


class ScriptedEngine:
    """Each step commits ``per_step`` tokens to every request (tau = per_step)."""

    def __init__(self, per_step: int, fast: tuple[str, ...] = (), fast_per_step: int = 0):
        self.per_step, self.fast, self.fast_per_step = per_step, fast, fast_per_step
        self.left: dict[str, int] = {}
        self.most_in_flight = 0

    def add_request(self, request_id, prompt_token_ids, params):
        self.left[request_id] = params.max_tokens
        self.most_in_flight = max(self.most_in_flight, len(self.left))

    def has_unfinished(self):
        return bool(self.left)

    def step(self):
        time.sleep(0.002)
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


def test_closed_loop_keeps_c_in_flight_and_skips_the_drain():
    """concurrency 2 over 3 prompts: bench-0 finishes in one step (9 tokens), bench-2 takes
    its place; steps 1-3 run 2 requests (9+3, 3+3, 3+3 tokens), the last one (bench-2's
    final 3) runs alone and is left out of the aggregate."""
    engine = ScriptedEngine(per_step=3, fast=("bench-0",), fast_per_step=9)
    r = run_batch(engine, [[1, 2]] * 3, max_tokens=9, mode="ngram", concurrency=2)
    assert engine.most_in_flight == 2
    assert (r.concurrency, r.output_tokens, r.step_ms) == (2, 27, pytest.approx(1000 * r.wall_s / 4))
    full_s = 24 / r.agg_tok_s                 # 24 tokens in the three full steps
    assert 3 * 0.002 <= full_s < r.wall_s
    with pytest.raises(ValueError, match="concurrency"):
        run_batch(engine, [[1, 2]], max_tokens=9, mode="ngram", concurrency=2)


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
