"""End to end on the CPU (issue 17): stock sglang 0.5.23 serves the default model in fp32
through ``sglang.launch_server`` (scheduler, model runners, DSPARK worker v2, FutureMap) with
our ``DSPARK_SERVE`` plugin, SGLang's own ``DSPARK`` and no speculation, on the test harness
in ``cpu_harness/`` (``conftest.cpu_server``).

Each server is started once per module, queried, and stopped before the next one starts
(fixtures ``_collect``). Greedy replies are compared token for token; the T = 1 min-p check
is a chi-square test of the first two generated tokens (the second one goes through the
speculative accept). Per-request sampling seeds act only under deterministic inference, and
the accept's uniforms come from the server's RNG, so the servers get a fixed --random-seed.
"""
from __future__ import annotations

import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

pytest.importorskip("sglang", reason="sglang not installed (pip install 'dspark-serve[sglang]')")

from dspark_serve.data.prompt_sets import load_prompts  # noqa: E402
from dspark_serve.assets.default_drafter import (SGLANG_DRAFTER_KIND,  # noqa: E402
                                                 shipped_drafter_path)
from dspark_serve.assets.default_model import MODEL_NAME  # noqa: E402
from dspark_serve.scheduling.cost_table import CostTable  # noqa: E402

# deselected from the main suite (pytest.ini); .ci/run runs them in its SGLang step
pytestmark = [pytest.mark.slow, pytest.mark.sglang_e2e]

NUM_PROMPTS = 6
NEW_TOKENS = 24
CONCURRENCY = 3
JOIN_DELAY_S = 1.0
MIN_P = 0.05
MIN_P_SAMPLES = 150
MIN_P_PROMPT = "Name one colour."
# Two-sample chi-square: false alarm rate of a correct sampler.
ALPHA = 1e-3


@dataclass
class Run:
    """What one server answered before it was stopped."""

    name: str
    started_in_s: float
    greedy_c1: list[list[int]] = field(default_factory=list)
    greedy_c3: list[list[int]] = field(default_factory=list)
    accept_length: float | None = None        # generated tokens per verify step
    pairs: list[tuple[int, int]] = field(default_factory=list)   # T=1 min-p (t1, t2)
    alive_after: bool = False
    log: str = ""
    seconds: float = 0.0


@pytest.fixture(scope="module")
def prompts(default_model) -> list[list[int]]:
    """Chat-formatted MT-Bench prompts as token ids; the last one is the min-p prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    texts = load_prompts("mtbench", NUM_PROMPTS) + [MIN_P_PROMPT]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                           add_generation_prompt=True) for t in texts]
    return [tokenizer.encode(chat, add_special_tokens=False) for chat in chats]


@pytest.fixture(scope="module")
def spec_args(tmp_path_factory) -> dict[str, list[str]]:
    """Server flags of each speculative algorithm: the shipped drafter and one flat cost table
    (every positive-survival draft pays off: right for equality, says nothing of speed)."""
    draft = shipped_drafter_path(MODEL_NAME, SGLANG_DRAFTER_KIND)
    assert draft is not None, f"no shipped SGLang-compatible DSpark drafter for {MODEL_NAME}"
    table = tmp_path_factory.mktemp("sps") / "flat_sps.json"
    CostTable((1, 4096), (100.0, 100.0), 4096).save(str(table))
    common = ["--speculative-draft-model-path", str(draft),
              "--speculative-dspark-sps-table-path", str(table)]
    return {name: ["--speculative-algorithm", name, *common] for name in ("DSPARK_SERVE", "DSPARK")}


def _greedy(server, prompts, concurrency: int) -> tuple[list[list[int]], list[dict]]:
    def ask(index):
        # Staggered starts, so requests join batches that are already decoding.
        time.sleep(JOIN_DELAY_S * (index % concurrency))
        reply = server.generate(prompts[index], temperature=0, max_new_tokens=NEW_TOKENS)
        return reply["output_ids"], reply["meta_info"]

    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(ask, range(len(prompts))))
    return [ids for ids, _ in replies], [meta for _, meta in replies]


def _min_p_pairs(server, prompt) -> list[tuple[int, int]]:
    def ask(_):
        reply = server.generate(prompt, temperature=1.0, min_p=MIN_P, max_new_tokens=2,
                                ignore_eos=True)
        return tuple(reply["output_ids"])

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(ask, range(MIN_P_SAMPLES)))


def _accept_length(metas: list[dict]) -> float:
    """Generated tokens per verify step over the replies (SGLang's ``spec_accept_length``)."""
    steps = sum(m["spec_verify_ct"] for m in metas)
    return sum(m["completion_tokens"] for m in metas) / steps


def _collect(cpu_server, name, prompts, *args, ragged_mode=None, concurrent=True,
             min_p=False) -> Run:
    begin = time.monotonic()
    with cpu_server(name, *args, ragged_mode=ragged_mode) as server:
        run = Run(name, server.started_in_s)
        greedy = prompts[:NUM_PROMPTS]
        run.greedy_c1, metas = _greedy(server, greedy, 1)
        if concurrent:
            run.greedy_c3, more = _greedy(server, greedy, CONCURRENCY)
            metas += more
        if "--speculative-algorithm" in args:
            run.accept_length = _accept_length(metas)
        if min_p:
            run.pairs = _min_p_pairs(server, prompts[NUM_PROMPTS])
        run.alive_after = server.alive()
        run.log = server.log.read_text(errors="replace")
    run.seconds = time.monotonic() - begin
    print(f"[{name}] start {run.started_in_s:.0f} s, total {run.seconds:.0f} s, "
          f"accept length {run.accept_length}")
    return run


@pytest.fixture(scope="module")
def no_spec(cpu_server, prompts) -> Run:
    return _collect(cpu_server, "none", prompts, min_p=True)


@pytest.fixture(scope="module")
def serve_compact(cpu_server, prompts, spec_args) -> Run:
    return _collect(cpu_server, "dspark_serve_compact", prompts, *spec_args["DSPARK_SERVE"],
                    ragged_mode="compact", min_p=True)


@pytest.fixture(scope="module")
def serve_static(cpu_server, prompts, spec_args) -> Run:
    return _collect(cpu_server, "dspark_serve_static", prompts, *spec_args["DSPARK_SERVE"],
                    ragged_mode="static")


@pytest.fixture(scope="module")
def serve_compact_no_overlap(cpu_server, prompts, spec_args) -> Run:
    return _collect(cpu_server, "dspark_serve_compact_no_overlap", prompts,
                    *spec_args["DSPARK_SERVE"], "--disable-overlap-schedule",
                    ragged_mode="compact")


@pytest.fixture(scope="module")
def sglang_dspark(cpu_server, prompts, spec_args) -> Run:
    return _collect(cpu_server, "sglang_dspark_compact", prompts, *spec_args["DSPARK"],
                    ragged_mode="compact", concurrent=False)


def _first_difference(expected: list[list[int]], got: list[list[int]]) -> str:
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"prompt {i}: first difference at token {k}: {a[k:k + 4]} vs {b[k:k + 4]}"
    return "lengths differ"


def test_no_speculation_fp32_is_batch_invariant(no_spec):
    """Equality at concurrency 3 means something only if no speculation itself does not
    depend on the batch (it does in bf16 on this CPU)."""
    assert len(no_spec.greedy_c1) == NUM_PROMPTS
    assert all(len(ids) == NEW_TOKENS for ids in no_spec.greedy_c1), "a reply stopped early"
    assert no_spec.greedy_c3 == no_spec.greedy_c1, _first_difference(no_spec.greedy_c1,
                                                                     no_spec.greedy_c3)


@pytest.mark.parametrize("config", ["serve_compact", "serve_static",
                                    "serve_compact_no_overlap"])
def test_dspark_serve_greedy_equals_no_speculation(request, no_spec, config):
    run: Run = request.getfixturevalue(config)
    for got in (run.greedy_c1, run.greedy_c3):
        assert got == no_spec.greedy_c1, f"{run.name}: {_first_difference(no_spec.greedy_c1, got)}"
    assert run.accept_length > 1.0, f"{run.name}: no draft was ever accepted"


def test_dspark_serve_and_sglang_dspark_agree(serve_compact, sglang_dspark, capsys):
    with capsys.disabled():
        print(f"\naccept length (tokens per verify step, greedy, {NUM_PROMPTS} MT-Bench "
              f"prompts x {NEW_TOKENS} tokens): DSPARK_SERVE {serve_compact.accept_length:.3f}"
              f", SGLang DSPARK {sglang_dspark.accept_length:.3f}")
    assert sglang_dspark.greedy_c1 == serve_compact.greedy_c1, _first_difference(
        serve_compact.greedy_c1, sglang_dspark.greedy_c1)
    assert sglang_dspark.accept_length > 1.0


def test_requests_joining_a_running_compact_overlap_batch_keep_the_scheduler_alive(
        serve_compact):
    """Issue 17's crash: a request joining a running compact-mode batch under the overlap
    scheduler got an unwritten relay row and our planner raised, killing the scheduler."""
    # Prefill lines while requests were running: requests did join a running batch.
    joined = [int(n) for n in re.findall(r"Prefill batch.*#running-req: (\d+)",
                                         serve_compact.log)]
    assert any(n >= 1 for n in joined), "no request joined a running batch"
    assert serve_compact.alive_after, "the server died"
    assert "Traceback" not in serve_compact.log, serve_compact.log[-4000:]
    assert len(serve_compact.greedy_c3) == NUM_PROMPTS


def test_dspark_serve_min_p_sampling_matches_no_speculation(no_spec, serve_compact):
    """T = 1, min-p: the joint law of the first two tokens equals no speculation's (two-sample
    chi-square over the frequent pairs plus one 'other' cell)."""
    from scipy.stats import chi2_contingency

    base, spec = Counter(no_spec.pairs), Counter(serve_compact.pairs)
    pooled = base + spec
    cells = [pair for pair, n in pooled.most_common() if n >= 10]
    assert len(cells) >= 3, f"too few frequent pairs for a test: {pooled.most_common(5)}"
    table = [[c[pair] for pair in cells] + [sum(c.values()) - sum(c[p] for p in cells)]
             for c in (base, spec)]
    if table[0][-1] + table[1][-1] == 0:        # no rare pairs: no 'other' cell
        table = [row[:-1] for row in table]
    p_value = chi2_contingency(table).pvalue
    assert p_value > ALPHA, f"min-p samples differ (p = {p_value:.2e}): {table}"
