"""Engine construction: load the tokenizer, config and target, resolve the drafter, and set up
the speculator with its cost table (loaded, or SPS(B) profiled on this machine at startup,
paper Section 3.2.2), STS calibration and prompt-lookup calibration.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from dspark_serve.assets.default_drafter import (LOOKUP_GAMMA, build_drafter, draft_vocab_ids,
                                                 drafter_source, shipped_corpus,
                                                 shipped_lookup_calibration)
from dspark_serve.assets.default_model import MODEL_NAME, default_model_path
from dspark_serve.calibration.io import load_sts_calibration
from dspark_serve.calibration.lookup import FILE_NAME as LOOKUP_FILE_NAME
from dspark_serve.calibration.lookup import LookupCalibration
from dspark_serve.drafter.corpus_lookup import FILE_NAME as CORPUS_FILE_NAME
from dspark_serve.drafter.corpus_lookup import CorpusIndex, load_corpus
from dspark_serve.engine.config import DRAFTER_MODES, LOOKUP_MODES, SHIPPED, EngineConfig
from dspark_serve.engine.speculator import LookupConfig, Speculator
from dspark_serve.model.kv_cache import KVCache
from dspark_serve.model.target_model import TargetModel
from dspark_serve.model.target_weights import TargetWeights
from dspark_serve.profiling.runner import profile_cost_table
from dspark_serve.scheduling import NEEDS_COST_TABLE
from dspark_serve.scheduling.cost_table import CostTable

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """Everything an ``LLMEngine`` runs on.

    tokenizer: the target's Hugging Face tokenizer (with its chat template).
    model_name: served model name. eos_ids: end-of-sequence token ids.
    max_model_len: context limit in tokens. vocab_size: V.
    target, kv: the target model and its KV cache (``max_num_seqs`` slots over a page pool).
    speculator: drafting + verify-length scheduling, None without speculation.
    gamma: draft tokens per round (0 without speculation).
    generator: the engine's RNG (requests without a seed draw from it).
    """

    tokenizer: object
    model_name: str
    eos_ids: set[int]
    max_model_len: int
    vocab_size: int
    target: TargetModel
    kv: KVCache
    speculator: Speculator | None
    gamma: int
    generator: torch.Generator


def build_engine(config: EngineConfig, target_weights: TargetWeights | None = None
                 ) -> EngineParts:
    """Load and set up everything ``config`` names; ``target_weights`` (loaded with the same
    model, dtype and quantization) are used instead of loading the target again: engines
    that share them read the same memory, so a benchmark between them compares speculation,
    not where each copy's pages landed (measured: ~10 % between identical engines).

    Raises:
        ValueError: an inconsistent configuration (drafter does not fit the target, gamma
            larger than the drafter's block, bad calibration or cost table).
    """
    path = config.model or default_model_path()
    model_name = Path(path).name if config.model else MODEL_NAME
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf_config = AutoConfig.from_pretrained(path)
    model_len = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None and model_len is None:
        raise ValueError("the model config has no max_position_embeddings: set max_model_len")
    max_model_len = min(config.max_model_len or model_len, model_len or 1 << 30)
    draft_path = draft_config = None
    if config.speculative in DRAFTER_MODES:
        mask_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        kind = "dspark" if config.speculative == "hybrid" else config.speculative
        draft_path, draft_config = drafter_source(hf_config, kind, model_name, mask_id,
                                                  config.draft)
    taps = draft_config.target_layer_ids if draft_config else ()
    target = (TargetModel(target_weights, hf_config, taps) if target_weights is not None else
              TargetModel.from_pretrained(path, dtype=config.dtype, target_layer_ids=taps,
                                          quantization=config.quantization))
    vocab_size = int(hf_config.vocab_size)
    kv = target.new_kv_cache(config.max_num_seqs, max_model_len,
                             config.kv_pool_tokens(max_model_len))
    generator = torch.Generator(device=target.device).manual_seed(config.seed)
    speculator, gamma = None, 0
    if config.speculative != "none":
        drafter = None
        if draft_config is not None:
            vocab = draft_vocab_ids(draft_path, draft_config, config.draft_vocab_size)
            drafter = build_drafter(target, draft_path, draft_config, seed=config.seed,
                                    draft_vocab=vocab)
        lookup = None
        if config.speculative in LOOKUP_MODES:
            corpus, corpus_calibration = _corpus(config, model_name)
            lookup = LookupConfig(min_match=config.lookup_min_match,
                                  calibration=_lookup_calibration(config, model_name),
                                  corpus=corpus, corpus_calibration=corpus_calibration)
        gamma = config.gamma or (drafter.gamma if drafter else LOOKUP_GAMMA)
        scheduler = "static" if config.speculative == "dflash" else config.scheduler
        speculator = Speculator(
            drafter, lookup=lookup, vocab_size=vocab_size, gamma=gamma,
            scheduler=scheduler,
            cost_table=_cost_table(config, scheduler, target, kv, max_model_len, model_name),
            temperatures=_sts(config, draft_path, gamma, target.device) if drafter else None,
            threshold=config.threshold, max_batch_tokens=config.max_batch_tokens,
            num_slots=config.max_num_seqs, max_len=max_model_len,
            always_draft=config.always_draft)
    return EngineParts(tokenizer, model_name, _eos_ids(tokenizer, hf_config), max_model_len,
                       vocab_size, target, kv, speculator, gamma, generator)


def _eos_ids(tokenizer, hf_config) -> set[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return {int(i) for i in ids if i is not None}


def _cost_table(config: EngineConfig, scheduler: str, target: TargetModel, kv: KVCache,
                max_model_len: int, model_name: str) -> CostTable | None:
    """The SPS cost table: ``config.cost_table``, else a startup profile when the scheduler
    needs one."""
    if config.cost_table:
        return CostTable.load(config.cost_table)
    if scheduler not in NEEDS_COST_TABLE:
        return None
    max_b = config.max_batch_tokens or config.max_num_seqs * ((config.gamma or 16) + 1)
    logger.info("profiling SPS(B) up to B=%d on this machine (--cost-table skips this)", max_b)
    return profile_cost_table(target, kv, max_batch_tokens=max_b,
                              context_len=min(256, max_model_len // 2),
                              meta={"model": model_name})


def _lookup_calibration(config: EngineConfig, model_name: str) -> LookupCalibration | None:
    path = config.lookup_calibration or shipped_lookup_calibration(model_name)
    return LookupCalibration.load(path) if path else None


def _corpus(config: EngineConfig, model_name: str
            ) -> tuple[CorpusIndex | None, LookupCalibration | None]:
    """Hybrid's corpus lookup and its survival table (``config.corpus``: a folder, or
    "shipped" for the target's shipped corpus); (None, None) without one or in other modes.
    Raises ValueError for a missing corpus or a malformed file."""
    if config.speculative != "hybrid" or config.corpus is None:
        return None, None
    folder = shipped_corpus(model_name) if config.corpus == SHIPPED else Path(config.corpus)
    if folder is None:
        raise ValueError(f"no corpus is shipped for {model_name}: build one with "
                         f"`dspark-serve corpus` and pass its folder")
    if not (folder / CORPUS_FILE_NAME).is_file():
        raise ValueError(f"{folder} has no {CORPUS_FILE_NAME} (`dspark-serve corpus` builds it)")
    sequences, _ = load_corpus(folder / CORPUS_FILE_NAME)
    calibration = folder / LOOKUP_FILE_NAME
    return (CorpusIndex(sequences),
            LookupCalibration.load(calibration) if calibration.is_file() else None)


def _sts(config: EngineConfig, draft_path: str | None, gamma: int,
         device: torch.device) -> torch.Tensor | None:
    """[gamma] STS temperatures: ``config.calibration``, else the drafter's shipped file."""
    path = config.calibration
    if path is None and draft_path is not None:
        shipped = Path(draft_path) / "sts_calibration.json"
        path = str(shipped) if shipped.is_file() else None
    if path is None:
        return None
    return load_sts_calibration(path).temperatures_for(gamma, device)
