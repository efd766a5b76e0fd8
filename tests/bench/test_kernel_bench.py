"""The CUDA kernel benchmark's CPU-side parts: dry run, the plan the issue asks for, the
reference callables and traffic floors of its cases, the table, and the GPU check script's
options."""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

from dspark_serve.bench import kernels
from dspark_serve.bench.kernel_cases import (MARKOV_HIDDEN, MARKOV_RANK, AttentionCase, MarkovCase,
                                             attention_plan, boundary_safe_uniforms, markov_plan,
                                             prepare_attention, prepare_markov)
from dspark_serve.ops import markov_sample_reference
from dspark_serve.types import SamplingTensors


def test_dry_run_prints_plan_and_touches_no_gpu(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert kernels.main(argparse.Namespace(dry_run=True, quick=False)) == 0
    out = capsys.readouterr().out
    assert "plan: 43 cases (36 Markov sampling, 7 verify attention)" in out
    assert "markov R=128 g=16 V=151936 T.8/p.95" in out and "attn 256x16@512 T=4096 D=128" in out


def test_dry_run_rejects_unwritable_out(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path / "missing"))
    assert kernels.main(argparse.Namespace(dry_run=True, quick=True)) == 2


def test_plan_covers_issue_grid():
    cases = markov_plan(quick=False)
    assert {(c.rows, c.gamma, c.vocab) for c in cases} == {
        (r, g, v) for r in (1, 32, 128) for g in (5, 7, 16) for v in (49152, 151936)}
    tokens = [sum(n for _, n in c.requests) for c in attention_plan(quick=False)]
    contexts = [ctx for c in attention_plan(quick=False) for ctx, _ in c.requests]
    assert max(tokens) == 4096 and min(contexts) >= 512 and max(contexts) == 8192


def test_case_references_and_floors_on_cpu():
    markov = prepare_markov(MarkovCase(2, 3, 64, greedy=False), None, device="cpu")
    block = markov.reference()
    assert block.tokens.shape == (2, 3) and torch.allclose(block.probs.sum(-1), torch.ones(2, 3))
    assert markov.bytes == (2 * 3 * 64 * (2 + 4) + 3 * 64 * MARKOV_RANK * 2
                            + 2 * 3 * MARKOV_HIDDEN * 2)
    case = AttentionCase("t", ((40, 3), (17, 2)), hq=4, hkv=2, head_dim=64)
    attn = prepare_attention(case, None, device="cpu")
    assert attn.reference().shape == (5, 4, 64)
    assert attn.bytes == 2 * 5 * 4 * 64 * 2 + (40 + 17) * 2 * 64 * 2 * 2


def test_table_format():
    record = {"case": "markov R=1", "ok": True, "check": "", "ours_ms": 0.5, "reference_ms": 2.0,
              "floor_ms": 0.25, "peers": {"flashinfer top-p loop": 0.75, "x": "n/a: ImportError"}}
    row = kernels.format_table([record]).splitlines()[1]
    assert row.split()[:8] == ["markov", "R=1", "ok", "0.500", "2.000", "4.0", "0.250", "50%"]
    assert "flashinfer top-p loop 0.750" in row and "x n/a: ImportError" in row


def test_boundary_safe_uniforms_center_every_draw():
    g = torch.Generator().manual_seed(0)
    rows, gamma, vocab, rank = 4, 5, 3000, 16
    args = (torch.randn(rows, gamma, vocab, generator=g), torch.zeros(rows, gamma, 0),
            torch.randn(vocab, rank, generator=g), torch.randn(vocab, rank, generator=g) * 0.25,
            torch.randint(0, vocab, (rows,), generator=g))
    sampling = SamplingTensors.uniform(rows, temperature=1.0, top_p=0.9)
    u = boundary_safe_uniforms(*args, sampling, torch.rand(rows, gamma, generator=g))
    block = markov_sample_reference(*args, sampling, u)
    for r in range(rows):
        for k in range(gamma):
            p = block.probs[r, k].double()
            cdf, t = p.cumsum(0), int(block.tokens[r, k])
            x = float(u[r, k]) * float(cdf[-1])
            assert p[t] >= 1e-3 or t == int(p.argmax())
            # The draw sits at the middle of its token's interval, far from either boundary.
            assert min(x - float(cdf[t] - p[t]), float(cdf[t]) - x) > 0.49 * float(p[t])


def test_gpu_check_script_dry_run_and_usage():
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    done = subprocess.run([str(script), "--dry-run", "--sglang-only"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tok/s rows for none / DSPARK / DSPARK_SERVE at concurrency 1 and 32" in done.stdout
    bad = subprocess.run([str(script), "--fast"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert bad.returncode == 2 and "--kernels-only | --sglang-only" in bad.stderr
