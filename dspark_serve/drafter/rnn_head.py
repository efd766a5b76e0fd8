"""RNN head (paper Eq 6): a gated recurrence over the block carrying the whole prefix.

z_k = [s_{k-1}; W1[x_{k-1}]; h_k] (2r + d), one joint linear ``joint_proj`` (2r + d -> 3r)
split in thirds into gate g, candidate c and output o:
s_k = sigma(g) * s_{k-1} + (1 - sigma(g)) * tanh(c),  B_k = W2 tanh(o),  s_0 = 0, x_0 = anchor.
The bias reads tanh(o), not s_k. Tensor names and the [gate; candidate; output] order as in
DeepSpec's ``deepspec/modeling/dspark/markov_head.py::RNNHead`` (W1 = ``markov_w1``,
W2 = ``markov_w2``, shared with the Markov head).
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_serve.drafter.markov_head import MarkovHead


class RNNHead(MarkovHead):
    """Recurrent sequential head; same step interface as ``MarkovHead``."""

    recurrent = True

    def __init__(self, vocab_size: int, rank: int, hidden_size: int,
                 out_vocab_size: int | None = None):
        super().__init__(vocab_size, rank, out_vocab_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def init_state(self, batch_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """s_0 = 0: [*batch_shape, r] in the head's dtype on ``like``'s device."""
        return torch.zeros(*batch_shape, self.rank, dtype=self.joint_proj.weight.dtype,
                           device=like.device)

    def step(self, state: torch.Tensor | None, prev_tokens: torch.Tensor,
             hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One Eq 6 update: state [..., r], prev_tokens [...] int64, hidden [..., d].
        Returns (s_k [..., r], bias [..., V])."""
        if state is None:
            raise ValueError("RNNHead.step needs the previous state (init_state gives s_0)")
        emb = self.prev_embedding(prev_tokens)
        z = torch.cat([state, emb, hidden.to(emb.dtype)], dim=-1)
        gate, candidate, output = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        new_state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return new_state, self.markov_w2(torch.tanh(output))
