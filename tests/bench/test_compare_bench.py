"""``dspark-serve bench compare``: medians over rounds, ratios to plain decoding and to
llama.cpp, the table, and llama.cpp skipped with a reason when it cannot run."""
import sys

import pytest

from dspark_serve.bench import compare
from dspark_serve.bench.serving import CellResult


def cell(mode, conc, user, agg, tau=0.0):
    return CellResult(mode, conc, 100, 1.0, user, agg, 0.1, tau, 10.0)


def test_median_over_rounds():
    m = compare.median_cells([cell("ngram", 4, 10, 30), cell("ngram", 4, 30, 10),
                              cell("ngram", 4, 20, 20, tau=2.0)])
    assert (m.mode, m.concurrency, m.user_tok_s, m.agg_tok_s, m.tau) == ("ngram", 4, 20, 20, 2.0)
    # tau over the rounds that drafted; none drafted: 0
    assert compare.median_cells([cell("dspark", 1, 1, 1, 1.0), cell("dspark", 1, 1, 1, 0.0),
                                 cell("dspark", 1, 1, 1, 1.5)]).tau == 1.25
    assert compare.median_cells([cell("dspark", 1, 1, 1), cell("dspark", 1, 1, 1)]).tau == 0.0


def test_ratios_and_table():
    rows = compare.with_ratios([cell("none", 1, 20, 20), cell("hybrid", 1, 50, 50, 2.6),
                                cell("llama.cpp", 1, 40, 40), cell("none", 4, 10, 40),
                                cell("hybrid", 4, 15, 60, 2.2)])
    by = {(r.cell.mode, r.cell.concurrency): r for r in rows}
    assert (by["hybrid", 1].user_x, by["hybrid", 1].user_vs_llama) == (2.5, 1.25)
    assert (by["hybrid", 4].user_x, by["hybrid", 4].agg_x) == (1.5, 1.5)
    assert by["hybrid", 4].user_vs_llama is None          # no llama.cpp cell at c = 4
    lines = compare.format_rows(rows).splitlines()
    assert lines[0].split()[:2] == ["config", "conc"]
    assert [line.split()[:2] for line in lines[1:]] == [
        ["none", "1"], ["hybrid", "1"], ["llama.cpp", "1"], ["none", "4"], ["hybrid", "4"]]
    assert lines[2].split()[2:] == ["50.0", "50.0", "0.10", "2.60", "2.50", "2.50", "1.25"]


def test_llama_skipped_with_reason_when_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)     # import fails
    reason = compare.llama_unavailable()
    assert "llama-cpp-python is not installed" in reason and "GGML_AMX_INT8=OFF" in reason


def test_llama_amx_build_refused_on_amx_cpu(monkeypatch):
    fake = type(sys)("llama_cpp")
    fake.llama_print_system_info = lambda: b"CPU : AVX2 = 1 | AMX_INT8 = 1 |"
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    assert "rebuild" in compare.llama_unavailable(cpu_flags="fpu avx2 amx_tile amx_int8")
    assert compare.llama_unavailable(cpu_flags="fpu avx2 avx512f") is None


def test_our_engines_share_weights_and_one_cost_table(monkeypatch, tmp_path):
    """Every configuration runs on the first engine's target weights, and the first profiled
    cost table is handed to the others as a file (none profiles nothing)."""
    import argparse
    import json
    from types import SimpleNamespace

    built = []

    class Table:
        def save(self, path):
            with open(path, "w") as f:
                json.dump({"from": "first"}, f)

    class FakeEngine:
        def __init__(self, config, target_weights=None):
            table = None if config.cost_table else Table()
            loaded = None if not config.cost_table else json.load(open(config.cost_table))
            built.append((config.speculative, target_weights, loaded))
            self.target = SimpleNamespace(weights=target_weights or f"weights-{len(built)}")
            self.speculator = (None if config.speculative == "none"
                               else SimpleNamespace(scheduler=SimpleNamespace(cost_table=table)))

    monkeypatch.setattr(compare, "LLMEngine", FakeEngine)
    args = argparse.Namespace(draft=None, quantization="int4", cost_table=None)
    engines = compare._our_engines(["none", "dspark", "hybrid"], args, 4)
    assert list(engines) == ["none", "dspark", "hybrid"]
    assert built == [("none", None, None), ("dspark", "weights-1", None),
                     ("hybrid", "weights-1", {"from": "first"})]


def test_every_cell_serves_at_least_ten_prompts_the_same_for_every_configuration():
    assert [compare.cell_prompts(c) for c in (1, 2, 4, 16)] == [10, 10, 12, 48]


def test_llama_cell_is_a_closed_loop_of_its_users(monkeypatch):
    """Two users, three prompts served one after another, each 1 s to its first token and
    1 s per later token: request 2 arrives when request 0 finished (t = 3), starts at t = 6."""
    clock = [0.0]
    monkeypatch.setattr(compare.time, "perf_counter", lambda: clock[0])

    class FakeLlama:
        def reset(self):
            pass

        def create_completion(self, ids, max_tokens, **kw):
            for _ in range(max_tokens):
                clock[0] += 1.0
                yield {}

    runner = object.__new__(compare.LlamaRunner)
    runner.llama, runner.eos, runner.mode = FakeLlama(), 2, "llama.cpp"
    res = runner.run_batch([[1], [1], [1]], 3, users=2)
    # first tokens at t = 1, 4, 7; arrivals 0, 0, 3 (request 0 finished at 3)
    assert (res.concurrency, res.output_tokens, res.wall_s) == (2, 9, 9.0)
    assert res.ttft_s == pytest.approx((1 + 4 + 4) / 3)
    assert (res.user_tok_s, res.agg_tok_s) == (1.0, 1.0)
