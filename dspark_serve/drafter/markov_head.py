"""Markov head (paper Eq 5): a low-rank first-order transition bias added to the base logits.

B(x_{k-1}, .) = W1[x_{k-1}] W2 with W1 in R^{V x r} (an embedding table, ``markov_w1``) and
W2 in R^{r x V} (a bias-free logit projection, ``markov_w2``, stored as nn.Linear weight
[V, r]; [N, r] over a pruned draft vocabulary of N tokens, while W1 keeps all V rows because
x_{k-1} may be any target token); tensor names as DeepSpec's ``deepspec/modeling/dspark/markov_head.py::VanillaMarkov``.
x_0 is the anchor token: position 1's bias conditions on it. Also DeepSpec's gated variant
(``markov_head_type: gated``): B = W2 (sigma(gate_proj[h_k; W1[x_{k-1}]]) * W1[x_{k-1}]).

Every sequential head shares one step interface, used by ``block_sampler``:
``init_state(batch_shape, like)`` and ``step(state, prev_tokens, hidden) -> (state, bias)``;
``recurrent`` says whether the state carries information between positions.
"""
from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """Vanilla Markov head (Eq 5), memoryless beyond the previous token."""

    recurrent = False

    def __init__(self, vocab_size: int, rank: int, out_vocab_size: int | None = None):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"a Markov head needs rank > 0, got {rank}")
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_vocab_size or vocab_size, bias=False)

    def prev_embedding(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: [...] int64 -> [..., r] (also the confidence head's Markov feature)."""
        return self.markov_w1(prev_tokens)

    def init_state(self, batch_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """s_0 for ``batch_shape`` rows (None: this head keeps no state)."""
        return None

    def step(self, state: torch.Tensor | None, prev_tokens: torch.Tensor,
             hidden: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Bias for one position: prev_tokens [...] int64, hidden [..., d] (h_k, unused here).
        Returns (state, bias [..., V or N] in the head's dtype)."""
        return state, self.markov_w2(self.prev_embedding(prev_tokens))


class GatedMarkovHead(MarkovHead):
    """Markov bias with a per-position gate on the token embedding, computed from h_k."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int,
                 out_vocab_size: int | None = None):
        super().__init__(vocab_size, rank, out_vocab_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, state: torch.Tensor | None, prev_tokens: torch.Tensor,
             hidden: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        emb = self.prev_embedding(prev_tokens)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(emb.dtype), emb], dim=-1)))
        return state, self.markov_w2(gate * emb)
