"""Confidence head (paper Eq 7): c_k = sigma(w . [h_k; W1[x_{k-1}]]).

One linear layer ``confidence_head.proj`` (weight [1, d (+ r)], bias [1]) over the backbone
hidden h_k, concatenated (in that order) with the Markov embedding of the previous draft token
(x_0 = anchor) when ``confidence_head_with_markov`` is set; DeepSpec's ``AcceptRatePredictor``
(``deepspec/modeling/dspark/common.py``) and ``predict_confidence_step``
(``deepspec/modeling/dspark/qwen3/modeling.py``). It returns the raw logit; the sigmoid, with
the per-position STS temperatures, is applied by ``dspark_serve.calibration.sts``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConfidenceHead(nn.Module):
    """Linear confidence logit per draft position."""

    def __init__(self, hidden_size: int, markov_rank: int = 0):
        super().__init__()
        self.markov_rank = markov_rank
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor | None) -> torch.Tensor:
        """Args: hidden [..., d]; prev_embedding [..., r] = W1[x_{k-1}] (None without the
        Markov feature). Returns the logit w . features + b as [...] float32.
        Raises ValueError if the Markov feature is missing or unexpected."""
        if (prev_embedding is None) != (self.markov_rank == 0):
            raise ValueError(f"confidence head built with markov_rank {self.markov_rank} got "
                             f"prev_embedding {'None' if prev_embedding is None else 'tensor'}")
        features = hidden if prev_embedding is None else torch.cat(
            [hidden, prev_embedding.to(hidden.dtype)], dim=-1)
        # float32: the logit is returned in float32, and oneDNN's bfloat16 path for a
        # one-column output costs ~50 us per call on a CPU (a tenth of a compiled draft)
        return F.linear(features.float(), self.proj.weight.float(),
                        self.proj.bias.float()).squeeze(-1)
