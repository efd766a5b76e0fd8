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

    def __init__(self, per_step: int):
        self.per_step = per_step
        self.left: dict[str, int] = {}

    def add_request(self, request_id, prompt_token_ids, params):
        self.left[request_id] = params.max_tokens

    def has_unfinished(self):
        return bool(self.left)

    def step(self):
        time.sleep(0.002)
        outs = []
        for rid in list(self.left):
            n = min(self.per_step, self.left[rid])
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
    assert r.agg_tok_s == pytest.approx(36 / r.wall_s)
    assert r.step_ms == pytest.approx(1000 * r.wall_s / 3)  # three steps
    assert 0 < r.ttft_s < r.wall_s and r.user_tok_s > 0


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
