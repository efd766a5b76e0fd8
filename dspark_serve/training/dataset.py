"""Training data on disk: the prompt split and the regenerated sequences (token ids).

A data folder holds
- ``split.json``: ``{"source", "num_prompts", "seed", "train": [...], "heldout": [...]}``,
  indices into the deduplicated ShareGPT first user turns; held-out prompts are never trained
  on (``dspark-serve calibrate`` uses them);
- ``sequences.jsonl``: append-only, one JSON object per line and per train prompt:
  ``{"index", "prompt_ids", "response_ids", "temperature", "top_p", "finish_reason"}``
  (``finish_reason`` "skipped" with empty ``response_ids`` for a prompt over the length cap).
A line cut short by an interrupted run is dropped on reading and overwritten on resume.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

SPLIT_FILE = "split.json"
SEQUENCES_FILE = "sequences.jsonl"


@dataclass
class Sequence:
    """One training sequence: ids [T] int64 (prompt then response), loss_mask [T] bool
    (True on response tokens), and the sampling it was generated with."""

    index: int
    ids: torch.Tensor
    loss_mask: torch.Tensor
    temperature: float


def read_records(folder: str | Path) -> list[dict]:
    """Every complete record of ``sequences.jsonl`` (missing file: none), and truncates a torn
    last line so appending continues on a line boundary."""
    path = Path(folder) / SEQUENCES_FILE
    if not path.exists():
        return []
    raw = path.read_bytes()
    good = raw[:raw.rfind(b"\n") + 1]
    if len(good) != len(raw):
        with open(path, "r+b") as f:
            f.truncate(len(good))
    return [json.loads(line) for line in good.decode("utf-8").splitlines() if line.strip()]


def append_record(file, record: dict) -> None:
    """Write one record as a line and flush it to disk (``file`` opened in append mode)."""
    file.write(json.dumps(record, separators=(",", ":")) + "\n")
    file.flush()
    os.fsync(file.fileno())


def read_split(folder: str | Path) -> dict:
    """The split manifest. Raises FileNotFoundError when the folder has none."""
    path = Path(folder) / SPLIT_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `dspark-serve gen-data --out {folder}` "
                                "first")
    return json.loads(path.read_text(encoding="utf-8"))


def load_sequences(folder: str | Path, *, max_len: int, min_response: int = 2) -> list[Sequence]:
    """Training sequences of a data folder, truncated to ``max_len`` tokens; sequences with
    fewer than ``min_response`` response tokens left are dropped.
    Raises ValueError when nothing is left (no data generated yet)."""
    out = []
    for rec in read_records(folder):
        prompt, response = rec["prompt_ids"], rec["response_ids"]
        ids = (prompt + response)[:max_len]
        n_resp = len(ids) - len(prompt)
        if n_resp < min_response:
            continue
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(prompt):] = True
        out.append(Sequence(int(rec["index"]), torch.tensor(ids, dtype=torch.int64), mask,
                            float(rec["temperature"])))
    if not out:
        raise ValueError(f"no usable training sequences in {folder} (max_len {max_len})")
    return out
