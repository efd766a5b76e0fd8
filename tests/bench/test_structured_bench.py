"""``dspark-serve bench structured``: cell arithmetic on a scripted engine, the table, the
CLI, the JSON workload, and the real grammar backend's mask cost (``--masks``)."""
from __future__ import annotations

import argparse
import json

import pytest

from dspark_serve.bench import cli
from dspark_serve.bench.structured import (SCHEMAS, Cell, format_table, json_requests, mask_costs,
                                          run_cell)
from dspark_serve.engine.outputs import RequestOutput, SpecStats, StepStats


class ScriptedEngine:
    """Each step commits ``per_step`` tokens to every request and reports 10 ms of step time,
    2 of them grammar work."""

    def __init__(self, per_step: int):
        self.per_step, self.left, self.steps = per_step, {}, []

    def add_request(self, request_id, prompt_token_ids, params):
        self.left[request_id] = params.max_tokens

    def has_unfinished(self):
        return bool(self.left)

    def step(self):
        outs = []
        for rid in list(self.left):
            n = min(self.per_step, self.left[rid])
            self.left[rid] -= n
            outs.append(RequestOutput(rid, [7] * n, "x" * n, finished=not self.left[rid],
                                      stats=SpecStats(accepted_length=float(self.per_step))))
            if not self.left[rid]:
                del self.left[rid]
        self.steps.append(StepStats(step_seconds=0.010, grammar_seconds=0.002))
        return outs

    def pop_step_stats(self):
        steps, self.steps = self.steps, []
        return steps


def test_run_cell_counts_tokens_tau_and_grammar_share():
    from dspark_serve.engine.params import SamplingParams

    requests = [([1, 2], SamplingParams(max_tokens=8))] * 3
    c = run_cell(ScriptedEngine(per_step=2), "dspark", "json", requests)
    assert (c.mode, c.workload, c.concurrency, c.output_tokens, c.tau) == (
        "dspark", "json", 3, 24, 2.0)
    assert c.grammar_ms_per_step == pytest.approx(2.0)
    assert c.grammar_share == pytest.approx(0.2)
    assert c.agg_tok_s > 0 and c.user_tok_s > 0


def test_table_lists_every_cell():
    cells = [Cell("none", "json", 1, 30, 15.2, 13.4, 0.0, 0.49, 0.007),
             Cell("dspark", "text", 4, 256, 3.7, 13.9, 1.21, 0.0, 0.0)]
    lines = format_table(cells).splitlines()
    assert lines[1].split() == ["none", "json", "1", "15.2", "13.4", "-", "0.49", "0.7%"]
    assert lines[2].split() == ["dspark", "text", "4", "3.7", "13.9", "1.21", "0.00", "0.0%"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_defaults_and_bad_values():
    args = _parse(["bench", "structured"])
    assert (args.modes, args.concurrency, args.temperature, args.masks) == (
        ["none", "dspark", "dspark-unmasked"], [1, 4], 0.0, False)
    with pytest.raises(SystemExit):
        _parse(["bench", "structured", "--modes", "eagle"])


class _Tokenizer:
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return messages[0]["content"]

    def encode(self, text, add_special_tokens):
        return [len(text)]


def test_json_requests_cycle_through_the_schemas():
    requests = json_requests(_Tokenizer(), 5, 32, 1.0)
    schemas = [json.loads(p.structured.source) for _, p in requests]
    assert schemas == [s for _, s in SCHEMAS] + [SCHEMAS[0][1]]
    assert all(p.temperature == 1.0 and p.max_tokens == 32 for _, p in requests)


@pytest.mark.slow
def test_mask_costs_of_the_real_backend():
    costs = mask_costs(repeats=2)
    assert 0 < costs["xgrammar mask us/token"] < 5000
    assert costs["xgrammar compile ms"] > 0
