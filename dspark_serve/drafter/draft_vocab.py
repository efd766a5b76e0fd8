"""Pruned draft vocabulary (FR-Spec / EAGLE-3 style): the drafter predicts over N frequent
target tokens only, so its LM-head product, Markov W2 and sampling cost N/V of the full ones.

Format, as SGLang and vLLM name it for EAGLE-3: ``d2t`` [N] int64 offsets, target token id of
draft index i = i + d2t[i] (the ids sorted ascending), and ``t2d`` [V] bool, whether a target
token is in the draft vocabulary. Lossless by construction: the draft distribution is exactly
0 outside the N tokens, and rejection sampling only needs p_d(x) for drafted x plus the
residual max(0, p_t - p_d), which then keeps the target's mass outside in full.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file, save_file
from torch import nn

# A drafter folder's token ranking (most frequent first), from which the engine prunes the
# draft vocabulary at load (``dspark-serve prune-vocab --ranking-only`` writes it).
RANKING_FILE = "token_ranking.safetensors"


def check_token_ids(token_ids: torch.Tensor, vocab_size: int) -> None:
    """Raises ValueError unless token_ids is int64 [N], 0 < N <= V, strictly increasing, in
    [0, V)."""
    if token_ids.dim() != 1 or token_ids.dtype != torch.int64 or token_ids.numel() == 0:
        raise ValueError(f"draft token ids must be int64 [N] with N > 0, got {token_ids.dtype} "
                         f"{tuple(token_ids.shape)}")
    if token_ids.numel() > vocab_size or int(token_ids[0]) < 0 or int(token_ids[-1]) >= vocab_size:
        raise ValueError(f"draft token ids must lie in [0, {vocab_size}) (at most V of them)")
    if token_ids.numel() > 1 and not bool((token_ids[1:] > token_ids[:-1]).all()):
        raise ValueError("draft token ids must be strictly increasing")


def d2t_from_ids(token_ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 offsets: [N] int64 ids (ascending) -> [N] int64 d2t with id = i + d2t[i]."""
    return token_ids - torch.arange(token_ids.numel(), device=token_ids.device)


def ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """Inverse of ``d2t_from_ids``: [N] int64 offsets -> [N] int64 target token ids."""
    return d2t + torch.arange(d2t.numel(), device=d2t.device)


def t2d_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] bool: True at the draft vocabulary's target ids."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=token_ids.device)
    mask[token_ids] = True
    return mask


def pruned_lm_head(weight: torch.Tensor, token_ids: torch.Tensor) -> nn.Linear:
    """A frozen bias-free ``nn.Linear`` d -> N whose rows are the target LM head's rows
    ``weight[token_ids]`` ([V, d] -> [N, d], same dtype and device)."""
    rows = weight.detach().index_select(0, token_ids.to(weight.device))
    head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(rows.contiguous(), requires_grad=False)
    return head


def scatter_to_vocab(probs: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-space probabilities [..., N] -> full-vocabulary [..., V] (exactly 0 outside)."""
    out = probs.new_zeros(*probs.shape[:-1], vocab_size)
    return out.index_copy_(-1, token_ids, probs)


def token_ranking(token_streams: Iterable[Iterable[int]], vocab_size: int) -> torch.Tensor:
    """All V token ids, most frequent over ``token_streams`` first (ties and tokens never
    seen: lower id first): int64 [V]. Raises ValueError for an id outside [0, V)."""
    counts: Counter[int] = Counter()
    for stream in token_streams:
        counts.update(stream)
    if counts and not 0 <= min(counts) <= max(counts) < vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    return torch.tensor(sorted(range(vocab_size), key=lambda t: (-counts.get(t, 0), t)),
                        dtype=torch.int64)


def top_tokens(ranking: torch.Tensor, size: int) -> torch.Tensor:
    """The first ``size`` ids of a ``token_ranking`` ([V] int64), ascending: int64 [size].
    Raises ValueError for size outside 1..V."""
    if not 1 <= size <= ranking.numel():
        raise ValueError(f"draft vocabulary size must be in 1..{ranking.numel()}, got {size}")
    return ranking[:size].sort().values


def most_frequent_tokens(token_streams: Iterable[Iterable[int]], size: int,
                         vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids over ``token_streams`` (ties: lower id first),
    returned ascending as int64 [size]. Tokens never seen fill the rest by id, so the result
    always has ``size`` ids. Raises ValueError for size outside 1..V or an id outside [0, V)."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
    return top_tokens(token_ranking(token_streams, vocab_size), size)


def save_ranking(folder: str | Path, ranking: torch.Tensor) -> Path:
    """Write a ``token_ranking`` ([V] int64) into a drafter folder as ``RANKING_FILE``."""
    path = Path(folder) / RANKING_FILE
    save_file({"ranking": ranking.to(torch.int32).contiguous()}, str(path))
    return path


def load_ranking(folder: str | Path) -> torch.Tensor | None:
    """The drafter folder's ``RANKING_FILE`` as [V] int64, or None when it has none.
    Raises ValueError for a file that is not a permutation of 0..V-1."""
    path = Path(folder) / RANKING_FILE
    if not path.is_file():
        return None
    ranking = load_file(str(path))["ranking"].long()
    if ranking.dim() != 1 or not torch.equal(ranking.sort().values,
                                             torch.arange(ranking.numel())):
        raise ValueError(f"{path} is not a ranking of token ids 0..V-1")
    return ranking
