"""Prompt split, sampling shares and the resumable record file of gen-data."""
import json

import pytest

from dspark_serve.training.dataset import (SEQUENCES_FILE, append_record, load_sequences,
                                           read_records)
from dspark_serve.training.gen_data import GenDataConfig, prepare_split, sampling_for, split_prompts


def test_split_deduplicates_and_is_seeded_and_disjoint():
    prompts = ["a", " a ", "b", "", "c", "a", "d", "e", "f"]
    unique, m = split_prompts(prompts, num_prompts=5, heldout=2, seed=1)
    assert unique == ["a", "b", "c", "d", "e"]
    assert len(m["heldout"]) == 2 and len(m["train"]) == 3
    assert sorted(m["heldout"] + m["train"]) == list(range(5))
    assert split_prompts(prompts, 5, 2, 1)[1] == m
    with pytest.raises(ValueError, match="held-out"):
        split_prompts(["x", "y"], 5, 2, 0)


def test_resume_refuses_a_different_split(tmp_path):
    prompts = [f"p{i}" for i in range(20)]
    prepare_split(GenDataConfig(out=str(tmp_path), num_prompts=20, heldout=5), prompts)
    prepare_split(GenDataConfig(out=str(tmp_path), num_prompts=20, heldout=5), prompts)
    with pytest.raises(ValueError, match="new --out"):
        prepare_split(GenDataConfig(out=str(tmp_path), num_prompts=20, heldout=6), prompts)


def test_greedy_share_is_seeded_and_close_to_the_fraction():
    cfg = GenDataConfig(out="x", greedy_fraction=0.25, seed=3)
    picks = [sampling_for(i, cfg) for i in range(4000)]
    assert picks == [sampling_for(i, cfg) for i in range(4000)]
    assert set(picks) == {(0.0, 1.0), (0.2, 0.9)}
    greedy = sum(p == (0.0, 1.0) for p in picks)
    # binomial(4000, 0.25): mean 1000, sd 27.4; 5 sd bounds
    assert 863 < greedy < 1137


def test_torn_last_line_is_dropped_and_truncated(tmp_path):
    with open(tmp_path / SEQUENCES_FILE, "a", encoding="utf-8") as f:
        for i in range(2):
            append_record(f, {"index": i, "prompt_ids": [5, 6], "response_ids": [7, 8, 9],
                              "temperature": 0.0, "top_p": 1.0, "finish_reason": "stop"})
    with open(tmp_path / SEQUENCES_FILE, "ab") as f:
        f.write(b'{"index": 2, "prompt_')
    assert [r["index"] for r in read_records(tmp_path)] == [0, 1]
    assert (tmp_path / SEQUENCES_FILE).read_bytes().endswith(b"}\n")
    seqs = load_sequences(tmp_path, max_len=4)
    assert seqs[0].ids.tolist() == [5, 6, 7, 8]
    assert seqs[0].loss_mask.tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="no usable"):
        load_sequences(tmp_path, max_len=3)
    assert json.loads((tmp_path / SEQUENCES_FILE).read_text().splitlines()[0])["index"] == 0


def test_heldout_subset_answers_only_heldout_prompts_up_to_the_limit():
    from dspark_serve.training.gen_data import prompts_to_answer

    manifest = {"train": [0, 2, 3, 5], "heldout": [1, 4, 6]}
    cfg = GenDataConfig(out="x", num_prompts=7, heldout=3, subset="heldout", limit=2)
    assert prompts_to_answer(cfg, manifest, set()) == [1, 4]
    assert prompts_to_answer(cfg, manifest, {1}) == [4]
    assert prompts_to_answer(GenDataConfig(out="x", num_prompts=7, heldout=3), manifest,
                             {2}) == [0, 3, 5]
    with pytest.raises(ValueError, match="subset"):
        GenDataConfig(out="x", subset="test")
    with pytest.raises(ValueError, match="limit"):
        GenDataConfig(out="x", limit=0)
    skipped = GenDataConfig(out="x", num_prompts=7, heldout=3, limit=4, skip=1, num_shards=2)
    assert prompts_to_answer(skipped, manifest, set()) == [2, 5]   # train[1:4], every 2nd
    with pytest.raises(ValueError, match="skip"):
        GenDataConfig(out="x", skip=-1)


def test_shards_split_the_prompts_between_processes_without_overlap():
    from dspark_serve.training.gen_data import prompts_to_answer

    manifest = {"train": [0, 2, 3, 5, 7, 8, 9], "heldout": [1, 4, 6]}
    shards = [prompts_to_answer(GenDataConfig(out="x", num_prompts=10, heldout=3, limit=6,
                                              shard=s, num_shards=2), manifest, {3})
              for s in range(2)]
    assert shards == [[0, 7], [2, 5, 8]]
    with pytest.raises(ValueError, match="shard"):
        GenDataConfig(out="x", shard=2, num_shards=2)


def test_followups_come_from_train_conversations_only_deduplicated_and_seeded():
    from dspark_serve.data.prompt_sets import PromptRecord
    from dspark_serve.training.gen_data import followup_prompts, prompts_to_answer

    unique = ["open0", "open1", "open2", "open3"]
    manifest = {"train": [0, 2, 3], "heldout": [1]}
    followups = [PromptRecord("a", opener="open0"), PromptRecord("b", opener="open1"),
                 PromptRecord(" a ", opener="open2"),      # the same prompt again
                 PromptRecord("open3", opener="open2"),    # a prompt of the split itself
                 PromptRecord("c", opener="open9"),        # opener past num_prompts
                 PromptRecord("d", opener=" open3"), PromptRecord("e", opener="open2"),
                 PromptRecord("f", opener=None)]
    out = followup_prompts(followups, unique, manifest, seed=0)
    assert sorted(out) == ["a", "d", "e"]          # "b" belongs to a held-out conversation
    assert out == followup_prompts(followups, unique, manifest, seed=0)
    orders = {tuple(followup_prompts(followups, unique, manifest, seed=s)) for s in range(20)}
    assert len(orders) > 1
    cfg = GenDataConfig(out="x", num_prompts=4, heldout=1, subset="followups", limit=2)
    manifest = {**manifest, "followups": list(range(len(out)))}
    assert prompts_to_answer(cfg, manifest, {0}) == [1]
