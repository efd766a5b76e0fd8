"""``dspark-serve corpus``: greedy answers appended per chunk, resumed, sharded, merged into a
corpus file that corpus lookup loads."""
import json

from dspark_serve.cli import main
from dspark_serve.drafter.corpus_lookup import CorpusIndex, load_corpus

ARGS = ["--num-prompts", "3", "--max-new-tokens", "6", "--quantization", "none",
        "--max-num-seqs", "2"]


def test_corpus_command_shards_resumes_and_merges(tmp_path, capsys):
    out = tmp_path / "corpus"
    assert main(["corpus", "--out", str(out), "--shard", "1/2", *ARGS]) == 0
    shard = [json.loads(line) for line in (out / "answers-1.jsonl").open()]
    assert [row["index"] for row in shard] == [1] and len(shard[0]["output_ids"]) == 6
    assert not (out / "corpus.npz").exists()          # shards only answer
    assert main(["corpus", "--out", str(out), *ARGS]) == 0     # answers 0 and 2, merges
    merged = [json.loads(line) for line in (out / "answers.jsonl").open()]
    assert sorted(row["index"] for row in merged) == [0, 2]
    sequences, meta = load_corpus(out / "corpus.npz")
    assert [len(s) for s in sequences] == [6, 6, 6] and sequences[1].tolist() == shard[0][
        "output_ids"]
    assert meta["prompts"] == "sharegpt first 3" and meta["quantization"] == "none"
    assert CorpusIndex(sequences).num_tokens == 18
    capsys.readouterr()
    assert main(["corpus", "--out", str(out), *ARGS]) == 0     # nothing left: merge only
    assert "3 answers, 18 tokens" in capsys.readouterr().out
    assert len((out / "answers.jsonl").read_text().splitlines()) == 2
