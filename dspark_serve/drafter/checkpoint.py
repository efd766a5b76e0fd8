"""Drafter checkpoints: load DeepSpec DSpark and z-lab DFlash folders, save DeepSpec's format.

Both formats are a folder with ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), tensor names without a ``model.`` prefix:
``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and per layer i
``layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (+ ``.bias`` with attention_bias),
``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.{input,post_attention}_layernorm.weight``. DeepSpec adds
``markov_head.markov_w1.weight`` [V, r], ``markov_head.markov_w2.weight`` [V, r],
``markov_head.gate_proj.{weight,bias}`` (gated head), ``markov_head.joint_proj.{weight,bias}``
[3r, 2r+d] (RNN head) and ``confidence_head.proj.{weight,bias}`` [1, d(+r)], [1]
(``deepspec/modeling/dspark/{markov_head,common}.py``, ``qwen3/modeling.py``). A pruned
draft vocabulary (``draft_vocab_size`` N in config.json) adds ``d2t`` [N] int64 and ``t2d``
[V] bool (EAGLE-3's names and convention, ``dspark_serve.drafter.draft_vocab``), and
``markov_w2`` is then [N, r].

Shared modules: DeepSpec's ``Qwen3DSparkModel`` owns frozen copies of the target's embedding
and LM head, and ``save_pretrained`` writes them (``embed_tokens.weight``, ``lm_head.weight``);
its evaluator reloads them from the draft folder. z-lab's ``DFlashDraftModel`` owns neither and
calls the target's. We always use the target's: the loader skips those two tensors (checking
their shapes), and the saver writes them only with ``include_shared=True`` (so DeepSpec's own
``from_pretrained`` gets a complete model).

Label alignment (checked in the sources; both put block slot j at position anchor_pos + j,
anchor = slot 0, mask tokens after it):
- DeepSpec: slot j's output predicts the token at anchor_pos + j + 1 (``forward`` builds
  ``label_indices = anchor_positions + arange(1, block_size + 1)``, and the evaluator samples
  from ``block_hidden[:, :block_size]``), so the anchor's output is the first draft logit and
  gamma = block_size (the paper's "anchor as the first prediction position", Section 3.1).
- z-lab DFlash: slot j >= 1 predicts the token at anchor_pos + j (``dflash_generate`` takes
  ``model(...)[:, 1 - block_size:]`` and writes the samples to ``block_output_ids[:, 1:]``); the
  anchor's output is unused and gamma = block_size - 1.
Our convention is "gamma draft logits from slots label_offset..block_size-1", so DeepSpec loads
with label_offset 0 and DFlash with label_offset 1; the weights need no change. A DFlash-aligned
drafter cannot be saved in the DeepSpec format (``DSparkConfig.to_deepspec_dict`` refuses).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark_serve.drafter.config import DEEPSPEC_ARCHITECTURE, DFLASH_ARCHITECTURE, DSparkConfig
from dspark_serve.drafter.draft_vocab import (check_token_ids, d2t_from_ids, ids_from_d2t,
                                              pruned_lm_head, t2d_mask)
from dspark_serve.drafter.model import DSparkDrafter

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARED_KEYS = ("embed_tokens.weight", "lm_head.weight")
_BACKBONE_PREFIX = "backbone."
# Non-persistent RoPE tables some transformers versions still write; recomputed here.
_IGNORED_PREFIXES = ("rotary_emb.",)
# Tensors kept at the top level of the state_dict (everything else is the backbone's).
_TOP_LEVEL = ("markov_head.", "confidence_head.", "d2t")
T2D_KEY = "t2d"
# The Markov head's vocabulary-sized W2 rows: the tensor pruning and expanding cut or widen.
MARKOV_W2_KEY = "markov_head.markov_w2.weight"


def read_config(path: str | Path) -> DSparkConfig:
    """The ``DSparkConfig`` of a checkpoint folder, dispatching on ``architectures``.
    Raises ValueError for an unknown architecture or a bad config."""
    cfg = json.loads((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))
    arch = cfg.get("architectures")
    if arch == [DEEPSPEC_ARCHITECTURE]:
        return DSparkConfig.from_deepspec_dict(cfg)
    if arch == [DFLASH_ARCHITECTURE]:
        return DSparkConfig.from_dflash_dict(cfg)
    raise ValueError(f"unsupported drafter architectures {arch!r}; expected "
                     f"[{DEEPSPEC_ARCHITECTURE!r}] or [{DFLASH_ARCHITECTURE!r}]")


def load_drafter(path: str | Path, embed_tokens: Callable[[torch.Tensor], torch.Tensor],
                 lm_head: Callable[[torch.Tensor], torch.Tensor], *,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                 draft_vocab: torch.Tensor | None = None) -> DSparkDrafter:
    """Load a DeepSpec or DFlash drafter folder onto the target's embedding and LM head.

    Tensors keep the file's dtype unless ``dtype`` is given. ``draft_vocab`` ([N] int64
    ascending target ids) prunes the draft vocabulary while loading, exactly as
    ``prune_draft_vocab`` would on disk. With a pruned draft vocabulary the drafter's head is
    ``lm_head.weight``'s rows at the checkpoint's ids (``draft_vocab.pruned_lm_head``).
    Raises ValueError for a bad config, missing, unexpected or mis-shaped tensors, an invalid
    ``d2t`` / ``t2d``, ``draft_vocab`` for an already pruned drafter or with invalid ids, or a
    pruned drafter whose ``lm_head`` has no ``weight``.
    """
    config = read_config(path)
    tensors = _read_tensors(Path(path))
    if draft_vocab is not None:
        _prune(config, tensors, draft_vocab, path)
    if config.draft_vocab_size is not None:
        lm_head = _pruned_head(config, tensors, lm_head)
    for key in SHARED_KEYS:
        t = tensors.pop(key, None)
        if t is not None and tuple(t.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"{key} has shape {tuple(t.shape)}, expected "
                             f"({config.vocab_size}, {config.hidden_size})")
    for key in [k for k in tensors if k.startswith(_IGNORED_PREFIXES)]:
        del tensors[key]
    with torch.device("meta"):
        drafter = DSparkDrafter(config, embed_tokens, lm_head)
    expected = {to_file_key(k): v.shape for k, v in drafter.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint tensors do not match the config: missing {missing}, "
                         f"unexpected {unexpected}")
    bad = [f"{k}: {tuple(tensors[k].shape)} != {tuple(s)}" for k, s in expected.items()
           if tensors[k].shape != s]
    if bad:
        raise ValueError(f"checkpoint tensors have wrong shapes: {bad}")
    drafter.load_state_dict({from_file_key(k): t for k, t in tensors.items()}, assign=True)
    return drafter.to(device=device, dtype=dtype)


def save_drafter(drafter: DSparkDrafter, path: str | Path, *, include_shared: bool = False) -> None:
    """Write ``drafter`` as a DeepSpec DSpark folder (config.json + model.safetensors).

    ``include_shared`` also writes the target's embedding and LM head weights (their
    ``weight`` attributes) under DeepSpec's names. Raises ValueError for a DFlash-aligned
    drafter or, with ``include_shared``, shared modules without a ``weight``.
    """
    config = drafter.config.to_deepspec_dict()
    tensors = {to_file_key(k): t.detach().contiguous() for k, t in drafter.state_dict().items()}
    if drafter.draft_vocab is not None:
        tensors[T2D_KEY] = t2d_mask(drafter.draft_vocab, drafter.config.vocab_size)
    if include_shared:
        for key, module in zip(SHARED_KEYS, drafter.shared_modules):
            weight = getattr(module, "weight", None)
            if weight is None:
                raise ValueError(f"include_shared needs a module with a weight for {key}")
            # clone: a tied embedding/LM head would otherwise share storage, which
            # safetensors refuses to write.
            tensors[key] = weight.detach().clone().contiguous()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: t.cpu() for k, t in tensors.items()}, str(out / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                   encoding="utf-8")


def to_file_key(name: str) -> str:
    """Our state_dict name -> checkpoint tensor name (the backbone lives at the top level)."""
    return name[len(_BACKBONE_PREFIX):] if name.startswith(_BACKBONE_PREFIX) else name


def from_file_key(key: str) -> str:
    """Checkpoint tensor name -> our state_dict name."""
    return key if key.startswith(_TOP_LEVEL) else _BACKBONE_PREFIX + key


def _pruned_head(config: DSparkConfig, tensors: dict[str, torch.Tensor], lm_head):
    """Check ``d2t`` / ``t2d`` (``t2d`` is popped: it is derived) and return the pruned head."""
    ids = _draft_ids(config, tensors)
    t2d = tensors.pop(T2D_KEY, None)
    if t2d is not None and not torch.equal(t2d.bool(), t2d_mask(ids, config.vocab_size)):
        raise ValueError("t2d does not match d2t")
    weight = getattr(lm_head, "weight", None)
    if weight is None:
        raise ValueError("a pruned draft vocabulary needs the target's LM head with a weight")
    return pruned_lm_head(weight, ids)


def _draft_ids(config: DSparkConfig, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The draft vocabulary's [N] int64 target ids from ``tensors["d2t"]``, checked."""
    d2t = tensors.get("d2t")
    if d2t is None or d2t.shape != (config.draft_vocab_size,):
        raise ValueError(f"a drafter with draft_vocab_size {config.draft_vocab_size} needs d2t "
                         f"[{config.draft_vocab_size}], got "
                         f"{None if d2t is None else tuple(d2t.shape)}")
    ids = ids_from_d2t(d2t.long())
    check_token_ids(ids, config.vocab_size)
    return ids


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / INDEX_FILE
    if index.exists():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (folder / WEIGHTS_FILE).exists():
        files = [WEIGHTS_FILE]
    else:
        raise ValueError(f"{folder} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def prune_draft_vocab(path: str | Path, out: str | Path, token_ids: torch.Tensor) -> DSparkConfig:
    """Write the drafter folder at ``path`` to ``out`` with its draft vocabulary pruned to
    ``token_ids`` ([N] int64 ascending target ids): ``markov_w2`` keeps those rows, ``d2t`` /
    ``t2d`` are added, config.json gets ``draft_vocab_size``; other files (e.g. the STS
    calibration) are copied. Returns the new config.

    Raises:
        ValueError: a DFlash-aligned or already pruned drafter, or invalid ``token_ids``.
    """
    config = read_config(path)
    tensors = _read_tensors(Path(path))
    _prune(config, tensors, token_ids, path)
    _write_folder(path, out, config, tensors)
    return config


def expand_draft_vocab(path: str | Path, out: str | Path) -> DSparkConfig:
    """The inverse of ``prune_draft_vocab``: write the pruned drafter at ``path`` to ``out``
    with the full target vocabulary V, ``markov_w2`` [V, r] holding the trained rows at the
    draft vocabulary's ids and zeros elsewhere (no Markov bias outside), ``d2t`` / ``t2d`` and
    ``draft_vocab_size`` dropped, other files copied. Pruning the result back to the same ids
    (``load_drafter(draft_vocab=...)``, ``serve --draft-vocab-size``) gives exactly the drafter
    at ``path``; unpruned it also drafts tokens outside, which it was never trained on.
    Returns the new config.

    Raises:
        ValueError: ``path`` has no pruned draft vocabulary, or an invalid ``d2t``.
    """
    config = read_config(path)
    if config.draft_vocab_size is None:
        raise ValueError(f"{path} has no pruned draft vocabulary to expand")
    tensors = _read_tensors(Path(path))
    ids = _draft_ids(config, tensors)
    del tensors["d2t"]
    tensors.pop(T2D_KEY, None)
    if MARKOV_W2_KEY in tensors:
        rows = tensors[MARKOV_W2_KEY]
        tensors[MARKOV_W2_KEY] = rows.new_zeros(config.vocab_size,
                                                rows.shape[1]).index_copy_(0, ids, rows)
    config.draft_vocab_size = None
    _write_folder(path, out, config, tensors)
    return config


def _write_folder(path: str | Path, out: str | Path, config: DSparkConfig,
                  tensors: dict[str, torch.Tensor]) -> None:
    """``config`` and ``tensors`` as a DeepSpec folder ``out``, with the other files of the
    folder at ``path`` (calibrations, token ranking) copied."""
    dst = Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    for extra in Path(path).iterdir():
        if extra.is_file() and extra.name not in (CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE) \
                and not extra.name.startswith("model-"):
            shutil.copyfile(extra, dst / extra.name)
    save_file(tensors, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    (dst / CONFIG_FILE).write_text(json.dumps(config.to_deepspec_dict(), indent=2,
                                              sort_keys=True) + "\n", encoding="utf-8")


def _prune(config: DSparkConfig, tensors: dict[str, torch.Tensor], token_ids: torch.Tensor,
           path: str | Path) -> None:
    """Cut ``config`` and ``tensors`` (in place) to the draft vocabulary ``token_ids``:
    ``markov_w2`` keeps those rows, ``d2t`` / ``t2d`` are added."""
    if config.draft_vocab_size is not None:
        raise ValueError(f"{path} already has a pruned draft vocabulary")
    check_token_ids(token_ids, config.vocab_size)
    config.draft_vocab_size = int(token_ids.numel())
    if MARKOV_W2_KEY in tensors:
        tensors[MARKOV_W2_KEY] = tensors[MARKOV_W2_KEY].index_select(0, token_ids).contiguous()
    tensors["d2t"] = d2t_from_ids(token_ids)
    tensors[T2D_KEY] = t2d_mask(token_ids, config.vocab_size)
