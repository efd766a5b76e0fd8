"""Offline evaluation: metrics against hand-computed values, the rounds loop against oracle
drafters (tau = 1 + accepted, exact token accounting), and calibrate/eval end to end on tiny
models."""
import json
import math
import types

import pytest
import torch

from dspark_serve.calibration.io import load_sts_calibration
from dspark_serve.drafter.checkpoint import save_drafter
from dspark_serve.eval import calibrate_cli, eval_cli, loading
from dspark_serve.eval.metrics import (accepted_length, calibration_metrics,
                                       conditional_acceptance, threshold_sweep)
from dspark_serve.eval.rounds import run_rounds
from dspark_serve.types import DraftBlock


def test_accepted_length_and_conditional_acceptance():
    n = torch.tensor([0, 1, 3, 3, 2])
    assert accepted_length(n) == pytest.approx(1 + 9 / 5)
    # reached k: k=0 5, k=1 4, k=2 3, k=3 2
    assert conditional_acceptance(n, 4) == pytest.approx([4 / 5, 3 / 4, 2 / 3, 0.0])
    assert math.isnan(conditional_acceptance(torch.tensor([0]), 2)[1])


def test_threshold_sweep_truncates_at_first_low_confidence():
    logit = lambda c: math.log(c / (1 - c))
    conf = torch.tensor([[logit(0.9), logit(0.3), logit(0.9)],
                         [logit(0.2), logit(0.9), logit(0.9)]])
    n = torch.tensor([3, 1])
    rows = threshold_sweep(conf, n, thresholds=(0.0, 0.25, 0.5))
    # t=0: l = (3, 3), kept = (3, 1); t=0.25: l = (3, 0), kept = (3, 0);
    # t=0.5: l = (1, 0), kept = (1, 0)
    assert rows[0] == {"threshold": 0.0, "acceptance_rate": 4 / 6, "tokens_per_round": 3.0,
                       "verified_per_round": 3.0}
    assert rows[1] == {"threshold": 0.25, "acceptance_rate": 1.0, "tokens_per_round": 2.5,
                       "verified_per_round": 1.5}
    assert rows[2] == {"threshold": 0.5, "acceptance_rate": 1.0, "tokens_per_round": 1.5,
                       "verified_per_round": 0.5}
    # STS temperatures change c and therefore the cut: T_1 = 10 lifts row 1's 0.2 to 0.47
    rows = threshold_sweep(conf, n, torch.tensor([10.0, 1.0, 1.0]), thresholds=(0.25,))
    assert rows[0]["verified_per_round"] == 3.0 and rows[0]["acceptance_rate"] == 4 / 6


def test_calibration_metrics_raw_and_sts():
    torch.manual_seed(0)
    conf = torch.randn(400, 3)
    n = torch.randint(0, 4, (400,))
    m = calibration_metrics(conf, n, torch.tensor([2.0, 1.0, 0.5]))
    survived = n[:, None] >= torch.arange(1, 4)
    a1 = torch.sigmoid(conf[:, 0].double())
    brier = float(((a1 - survived[:, 0].double()) ** 2).mean())
    assert m["raw"]["brier"][0] == pytest.approx(brier)
    assert m["sts"]["brier"][0] == pytest.approx(
        float(((torch.sigmoid(conf[:, 0].double() / 2) - survived[:, 0].double()) ** 2).mean()))
    assert m["raw"]["mean_ece"] == pytest.approx(sum(m["raw"]["ece"]) / 3)
    assert calibration_metrics(conf, n)["sts"] is None


def greedy_reference(target, prompt, length):
    cache = target.new_kv_cache(1, len(prompt) + length + 1)
    slot = cache.allocate()
    ids, pos, out = torch.tensor(prompt), torch.arange(len(prompt)), []
    for _ in range(length):
        nxt = int(target.forward(ids, torch.full_like(pos, slot), pos, cache).logits[-1].argmax())
        out.append(nxt)
        ids, pos = torch.tensor([nxt]), pos[-1:] + 1
    return prompt + out


def oracle(references, vocab, wrong=False):
    """A drafter.draft replacement proposing the target's greedy continuation (or, with
    ``wrong``, a token that never is), one-hot probabilities, confidence logits = position."""
    def draft(cache, slots, anchors, anchor_positions, sampling, uniforms):
        r, g = anchors.numel(), uniforms.shape[1]
        rows = []
        for a, p in zip(anchors.tolist(), anchor_positions.tolist()):
            ref = next(x for x in references if len(x) > p + g and x[p] == a)
            toks = ref[p + 1:p + 1 + g]
            rows.append([(t + 1) % vocab for t in toks] if wrong else toks)
        tokens = torch.tensor(rows)
        probs = torch.nn.functional.one_hot(tokens, vocab).float()
        return DraftBlock(tokens, probs, torch.arange(g).float().repeat(r, 1))
    return draft


@pytest.mark.parametrize("wrong", [False, True])
def test_rounds_accounting_with_oracle_drafters(target, make_drafter, monkeypatch, wrong):
    drafter = make_drafter(target, "dspark")  # gamma 4
    prompts = [[5, 9, 13], [7, 7, 2, 30, 41]]
    refs = [greedy_reference(target, p, 40) for p in prompts]
    monkeypatch.setattr(drafter, "draft", oracle(refs, 64, wrong))
    rounds = run_rounds(target, drafter, prompts, gamma=3, temperature=0.0, max_new_tokens=13,
                        batch_size=1)
    expected_n = 0 if wrong else 3
    assert rounds.num_accepted.tolist() == [expected_n] * rounds.num_accepted.numel()
    per_prompt = math.ceil((13 - 1) / (expected_n + 1))   # first token, then rounds
    assert rounds.prompt_index.tolist() == [0] * per_prompt + [1] * per_prompt
    assert rounds.generated == 2 + (expected_n + 1) * 2 * per_prompt
    assert accepted_length(rounds.num_accepted) == 1 + expected_n
    assert rounds.conf_logits.shape == (2 * per_prompt, 3)


def test_rounds_real_drafter_counts_and_batch_independence(target, make_drafter):
    drafter = make_drafter(target, "dspark")
    prompts = [[5, 9, 13], [7, 7, 2, 30, 41], [11, 3]]
    one = run_rounds(target, drafter, prompts, temperature=1.0, max_new_tokens=10, batch_size=1,
                     seed=4)
    many = run_rounds(target, drafter, prompts, temperature=1.0, max_new_tokens=10,
                      batch_size=3, seed=4)
    # every committed token is a first token or one of a round's n + 1
    assert one.generated == 3 + int((one.num_accepted + 1).sum())
    order = torch.argsort(many.prompt_index, stable=True)
    assert one.num_accepted.tolist() == many.num_accepted[order].tolist()
    torch.testing.assert_close(one.conf_logits, many.conf_logits[order])


class FakeTokenizer:
    eos_token_id = 2

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return messages[0]["content"]

    def encode(self, text, add_special_tokens):
        return [3 + ord(c) % 60 for c in text]


def test_calibrate_and_eval_commands_end_to_end(tmp_path, target, make_drafter, monkeypatch,
                                                capsys):
    drafter = make_drafter(target, "dspark")
    save_drafter(drafter, tmp_path / "draft")
    pair = loading.Pair(target, drafter.eval(), FakeTokenizer(), {2}, str(tmp_path / "draft"))
    monkeypatch.setattr(loading, "load_pair", lambda *a, **k: pair)
    # the 70-token prompt is over max_prompt_tokens: skipped, the next one taken instead
    monkeypatch.setattr(calibrate_cli, "heldout_prompts",
                        lambda data, n: ["hello", "x" * 70, "a b c", "xyz", "unused"])
    args = types.SimpleNamespace(kind="dspark", draft=str(tmp_path / "draft"), data="unused",
                                 model=None,
                                 num_prompts=3, temperature=1.0, top_p=1.0, max_new_tokens=24,
                                 batch_size=2, out=None, png=None, dtype="float32", seed=0,
                                 draft_vocab_size=None, max_prompt_tokens=60)
    assert calibrate_cli.run(args) == 0
    cal = load_sts_calibration(tmp_path / "draft" / "sts_calibration.json")
    assert cal.gamma == 4 and cal.num_samples > 0 and "temperature=1" in cal.dataset
    assert "prompts=3 " in cal.dataset
    assert (tmp_path / "draft" / "reliability.png").stat().st_size > 1000
    import dspark_serve.data.prompt_sets as prompt_sets
    monkeypatch.setattr(prompt_sets, "load_prompts", lambda name, limit: ["q " + name, "w"])
    args = types.SimpleNamespace(model=None, draft=None, kind="dspark", engine=False,
                                 temperature=0.0,
                                 gamma=None, benchmarks="mtbench,humaneval", limit=2,
                                 max_new_tokens=16, batch_size=2, calibration=None,
                                 dtype="float32", seed=0, json=True, plots=str(tmp_path / "plots"),
                                 draft_vocab_size=None)
    assert eval_cli.run(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["benchmarks"]) == {"mtbench", "humaneval"}
    b = report["benchmarks"]["mtbench"]
    assert b["prompts"] == 2 and b["rounds"] > 0 and 1.0 <= b["tau"] <= 5.0
    assert report["macro_tau"] == pytest.approx(
        (b["tau"] + report["benchmarks"]["humaneval"]["tau"]) / 2)
    assert report["calibration_file"].endswith("sts_calibration.json")
    assert b["calibration"]["sts"] is not None and len(b["threshold_sweep"]) == 10
    assert (tmp_path / "plots" / "reliability_mtbench_T0.png").is_file()


@pytest.mark.slow
def test_offline_pair_drafts_over_the_served_vocabulary():
    """``calibrate`` and ``eval`` load the shipped drafter pruned as the engine serves it (the
    first 16,384 tokens of its ranking), or with its own full vocabulary at size 0."""
    from dspark_serve.assets.default_drafter import DRAFT_VOCAB_SIZE
    from dspark_serve.drafter.draft_vocab import load_ranking, top_tokens

    pair = loading.load_pair(None, None)
    expected = top_tokens(load_ranking(pair.draft_path), DRAFT_VOCAB_SIZE)
    assert torch.equal(pair.drafter.draft_vocab, expected)
    assert loading.load_pair(None, None, draft_vocab_size=0).drafter.draft_vocab is None


@pytest.mark.slow
def test_lookup_calibrate_and_engine_eval_commands(tmp_path, capsys):
    """``calibrate --kind ngram`` writes a [8 match lengths, gamma 7] survival table fitted on
    greedy ShareGPT outputs (``--kind corpus``: [24 support keys, gamma 7]); ``eval --kind
    ngram`` reports tau and acceptance per position."""
    from dspark_serve.calibration.lookup import LookupCalibration
    from dspark_serve.drafter.corpus_lookup import DEFAULT_MAX_NGRAM, num_keys

    out = tmp_path / "lookup.json"
    args = types.SimpleNamespace(kind="ngram", model=None, num_prompts=2, max_new_tokens=48,
                                 batch_size=2, out=str(out), dtype="bfloat16", seed=0)
    assert calibrate_cli.run(args) == 0
    cal = LookupCalibration.load(out)
    assert len(cal.conditional) == 8 and cal.gamma == 7 and cal.num_rounds > 0
    corpus_out = tmp_path / "corpus.json"    # the shipped corpus's table, by support key
    assert calibrate_cli.run(types.SimpleNamespace(**{**vars(args), "kind": "corpus",
                                                      "corpus": None,
                                                      "out": str(corpus_out)})) == 0
    corpus_cal = LookupCalibration.load(corpus_out)
    assert len(corpus_cal.conditional) == num_keys(DEFAULT_MAX_NGRAM) == 24
    assert corpus_cal.gamma == 7 and corpus_cal.num_rounds > 0
    args = types.SimpleNamespace(model=None, draft=None, kind="ngram", engine=False,
                                 temperature=0.0, gamma=None, benchmarks="mtbench", limit=2,
                                 max_new_tokens=24, batch_size=2, calibration=None,
                                 dtype="bfloat16", seed=0, json=True, plots=None,
                                 draft_vocab_size=None, corpus=None, lookup_min_match=None)
    capsys.readouterr()
    assert eval_cli.run(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    bench = report["benchmarks"]["mtbench"]
    assert report["kind"] == "ngram" and report["gamma"] == 7 and bench["prompts"] == 2
    assert bench["rounds"] > 0 and 1.0 <= bench["tau"] <= 8.0
    assert len(bench["conditional_acceptance"]) == 7
