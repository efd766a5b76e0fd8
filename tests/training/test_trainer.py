"""Small-scale training on a tiny synthetic target: the loss falls, checkpoints resume exactly,
the DFlash baseline trains with CE only, and the shipped folder loads in bfloat16."""
import json
import math
import shutil

import pytest
import torch

from dspark_serve.drafter.checkpoint import load_drafter, read_config
from dspark_serve.training.checkpointing import lr_lambda
from dspark_serve.training.trainer import TrainConfig, batch_for_step, train
from dspark_serve.training.dataset import load_sequences


def _log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def _config(tmp_path, **kw):
    values = dict(data=str(tmp_path / "data"), out=str(tmp_path / "run"), steps=40,
                  seqs_per_step=2, anchors_per_seq=6, dtype="float32", lr=3e-3,
                  warmup_ratio=0.05, log_every=1, save_every=10, seed=0)
    values.update(kw)
    return TrainConfig(**values)


def test_dspark_loss_decreases_and_final_checkpoint_loads(tmp_path, make_target, make_drafter,
                                                          write_sequences):
    write_sequences(tmp_path / "data")
    target = make_target()
    final = train(_config(tmp_path), progress=False, models=(target, make_drafter(target)))
    log = _log(tmp_path / "run")
    assert [r["step"] for r in log] == list(range(1, 41))
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    # every term is trained: CE, TV and the confidence BCE all fall
    for term in ("ce", "tv", "conf"):
        assert sum(r[term] for r in log[-5:]) < sum(r[term] for r in log[:5]), term
    assert log[-1]["expected_tau"] > log[0]["expected_tau"]
    # checkpoints: the last two kept, DeepSpec config, bfloat16 final folder
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-000030",
                                                                          "step-000040"]
    cfg = read_config(final)
    assert cfg.markov_rank == 8 and cfg.enable_confidence_head
    shipped = load_drafter(final, target.embed_tokens, target.lm_head)
    assert {p.dtype for p in shipped.parameters()} == {torch.bfloat16}


def test_resume_continues_exactly(tmp_path, make_target, make_drafter, write_sequences):
    write_sequences(tmp_path / "data")
    target = make_target()
    straight = _config(tmp_path, out=str(tmp_path / "a"), steps=12, save_every=6)
    train(straight, progress=False, models=(target, make_drafter(target)))
    # interrupted after step 10 (a checkpoint), then resumed with a fresh drafter object
    part = _config(tmp_path, out=str(tmp_path / "b"), steps=12, save_every=6)
    train(part, progress=False, models=(target, make_drafter(target)))
    for p in [tmp_path / "b" / "step-000012", tmp_path / "b" / "final"]:
        shutil.rmtree(p)
    lines = (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()[:6]
    (tmp_path / "b" / "train_log.jsonl").write_text("\n".join(lines) + "\n")
    train(part, progress=False, models=(target, make_drafter(target, seed=99)))
    a = load_drafter(tmp_path / "a" / "step-000012", target.embed_tokens, target.lm_head)
    b = load_drafter(tmp_path / "b" / "step-000012", target.embed_tokens, target.lm_head)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
    assert [r["loss"] for r in _log(tmp_path / "a")] == pytest.approx(
        [r["loss"] for r in _log(tmp_path / "b")], rel=1e-5)


def test_dflash_baseline_is_ce_only(tmp_path, make_target, make_drafter, write_sequences):
    write_sequences(tmp_path / "data")
    target = make_target()
    cfg = _config(tmp_path, kind="dflash", steps=20)
    assert (cfg.alpha_ce, cfg.alpha_tv, cfg.alpha_conf) == (1.0, 0.0, 0.0)
    final = train(cfg, progress=False, models=(target, make_drafter(target, "dflash")))
    log = _log(tmp_path / "run")
    assert all(r["loss"] == pytest.approx(r["ce"]) and r["tv"] == 0 for r in log)
    assert sum(r["ce"] for r in log[-5:]) < 0.8 * sum(r["ce"] for r in log[:5])
    c = read_config(final)
    assert c.markov_rank == 0 and not c.enable_confidence_head
    with pytest.raises(ValueError, match="does not match"):
        train(_config(tmp_path, out=str(tmp_path / "x")), progress=False,
              models=(target, make_drafter(target, "dflash")))


def test_data_order_and_schedule(tmp_path, write_sequences):
    write_sequences(tmp_path / "d", n=5, response_len=4)
    seqs = load_sequences(tmp_path / "d", max_len=64)
    # one epoch = a permutation of all sequences; the next epoch reshuffles
    epoch0 = [s.index for step in range(5) for s in batch_for_step(seqs, step, 1, seed=3)]
    assert sorted(epoch0) == list(range(5))
    assert [s.index for s in batch_for_step(seqs, 1, 2, seed=3)] == epoch0[2:4]
    assert lr_lambda(0, 100, 0.04) == pytest.approx(0.25)
    assert lr_lambda(3, 100, 0.04) == pytest.approx(1.0)
    assert lr_lambda(99, 100, 0.04) == pytest.approx(0.5 * (1 + math.cos(math.pi * 95 / 96)))


def test_time_budget_lowers_the_step_count_once(tmp_path, make_target, make_drafter,
                                                write_sequences):
    write_sequences(tmp_path / "data", n=4)
    target = make_target()
    # a budget already spent after the timed probe steps: the run stops right there
    cfg = _config(tmp_path, steps=500, time_budget_minutes=1e-4, save_every=100)
    train(cfg, progress=False, models=(target, make_drafter(target)))
    assert [r["step"] for r in _log(tmp_path / "run")] == [1, 2, 3, 4]
    state = torch.load(tmp_path / "run" / "step-000004" / "trainer_state.pt", weights_only=False)
    assert state["total_steps"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_init_from_starts_at_the_shipped_drafter(tmp_path, kind):
    """``--init-from`` warm-starts from a drafter folder: the run's drafter has its weights
    (float32) and config, on the default model."""
    from dspark_serve.assets.default_drafter import shipped_drafter_path
    from dspark_serve.assets.default_model import MODEL_NAME
    from dspark_serve.training.models import build_models

    shipped = shipped_drafter_path(MODEL_NAME, kind)
    if shipped is None:
        pytest.skip(f"no shipped {kind} drafter")
    cfg = _config(tmp_path, kind=kind, init_from=str(shipped))
    target, drafter, _ = build_models(cfg, resume_from=None)
    reference = load_drafter(shipped, target.embed_tokens, target.lm_head, dtype=torch.float32)
    assert drafter.config == read_config(shipped)
    expected = reference.state_dict()
    got = drafter.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
