"""Token sequences to cache target features for: target-generated responses (``gen-data``
folders) and ShareGPT assistant text (labelled by the target at train time, issue 15).

Each source yields ``(key, ids [T] int64, loss_mask [T] bool)`` in a fixed order; keys are
unique across sources, so a resumed ``cache-features`` skips what is cached. Only train
prompts of a split are used: held-out prompts stay out of training.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from dspark_serve.data.prompt_sets import load_records
from dspark_serve.training.dataset import read_records, read_split

Item = tuple[str, torch.Tensor, torch.Tensor]


def generated_sequences(folder: str | Path, *, max_len: int) -> Iterator[Item]:
    """Records of a ``gen-data`` folder (prompt + response, response supervised), cut to
    ``max_len`` tokens; records with fewer than 2 response tokens left are skipped."""
    name = Path(folder).resolve().name
    for rec in read_records(folder):
        ids = (rec["prompt_ids"] + rec["response_ids"])[:max_len]
        n_prompt = len(rec["prompt_ids"])
        if len(ids) - n_prompt < 2:
            continue
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[n_prompt:] = True
        yield f"gen:{name}:{rec['index']}", torch.tensor(ids, dtype=torch.int64), mask


def sharegpt_sequences(split_folder: str | Path, tokenizer, *, max_prompt_tokens: int,
                       max_len: int) -> Iterator[Item]:
    """ShareGPT first user turn + its assistant answer, rendered with the target's chat
    template, for the train prompts of ``split_folder/split.json`` (indices into the
    deduplicated first turns, as ``gen_data.split_prompts`` numbers them). The answer tokens
    are supervised; prompts over ``max_prompt_tokens`` and empty answers are skipped.
    Raises FileNotFoundError without a split."""

    split = read_split(split_folder)
    seen, unique = set(), []
    for rec in load_records("sharegpt"):
        key = rec.prompt.strip()
        if key and key not in seen:      # the same deduplication as gen_data.split_prompts
            seen.add(key)
            unique.append(rec)
    for index in split["train"]:
        rec = unique[index]
        if not (rec.reference or "").strip():
            continue
        user = [{"role": "user", "content": rec.prompt}]
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(
            user + [{"role": "assistant", "content": rec.reference}], tokenize=False)
        if not full.startswith(prompt):
            continue
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        if len(prompt_ids) > max_prompt_tokens:
            continue
        answer_ids = tokenizer.encode(full[len(prompt):], add_special_tokens=False)
        ids = (prompt_ids + answer_ids)[:max_len]
        if len(ids) - len(prompt_ids) < 2:
            continue
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(prompt_ids):] = True
        yield f"sharegpt:{index}", torch.tensor(ids, dtype=torch.int64), mask
