"""Target + drafter pair and chat prompts for the offline commands (``calibrate``, ``eval``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dspark_serve.assets.default_drafter import build_drafter, draft_vocab_ids, drafter_source
from dspark_serve.assets.default_model import MODEL_NAME, default_model_path
from dspark_serve.model.target_model import TargetModel


@dataclass
class Pair:
    """target: ``TargetModel`` tapped at the drafter's layers; drafter: ``DSparkDrafter``
    (eval mode, target dtype); tokenizer; eos_ids: token ids ending a response; draft_path."""

    target: object
    drafter: object
    tokenizer: object
    eos_ids: set[int]
    draft_path: str


def load_pair(model: str | None, draft: str | None, kind: str = "dspark",
              dtype: str = "bfloat16", draft_vocab_size: int | None = None) -> Pair:
    """Load the target (``model``, default SmolLM2-135M-Instruct) and the drafter at ``draft``
    (default: the drafter of ``kind`` shipped for the target), its draft vocabulary pruned at
    load as the engine does (``draft_vocab_size`` as ``serve --draft-vocab-size``: None = the
    default size where the folder ships a token ranking, 0 = the drafter's own), so offline
    numbers and calibrations are those of the drafter as served.

    Raises:
        ValueError: no drafter given or shipped, a drafter that does not fit the target, or a
            draft vocabulary size it cannot be pruned to.
    """
    from transformers import AutoConfig, AutoTokenizer

    path = model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf_config = AutoConfig.from_pretrained(path)
    mask_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    name = Path(path).name if model else MODEL_NAME
    draft_path, config = drafter_source(hf_config, kind, name, mask_id, draft)
    if draft_path is None:
        raise ValueError(f"no trained {kind} drafter for {name}: pass --draft")
    target = TargetModel.from_pretrained(path, dtype=dtype,
                                         target_layer_ids=config.target_layer_ids)
    drafter = build_drafter(target, draft_path, config,
                            draft_vocab=draft_vocab_ids(draft_path, config, draft_vocab_size))
    eos = getattr(hf_config, "eos_token_id", None)
    eos_ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, (list, tuple)) else [eos])}
    return Pair(target, drafter, tokenizer, {int(i) for i in eos_ids if i is not None},
                draft_path)


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as a single user turn through the target's chat template (as the server
    renders a chat request), as token ids."""
    out = []
    for text in texts:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(rendered, add_special_tokens=False))
    return out
