"""Dataclasses that cross module boundaries. Shape symbols:

R: requests in the step, gamma: block size (draft tokens per request), V: vocabulary,
d: drafter hidden size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Weight / activation dtypes the engine serves in, by their CLI / config names.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SamplingTensors:
    """Per-request sampling parameters, applied identically to draft and target (warping order:
    temperature, top-k, top-p, min-p; see ``dspark_serve.sampling.warping``).

    temperature: [R] float32; 0 means greedy (one-hot argmax distribution).
    top_k:       [R] int64; 0 (or >= V) disables.
    top_p:       [R] float32; 1.0 disables.
    min_p:       [R] float32; 0.0 disables.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    @classmethod
    def uniform(cls, n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0, device: torch.device | str = "cpu") -> "SamplingTensors":
        """The same parameters for ``n`` rows."""
        return cls(
            temperature=torch.full((n,), float(temperature), dtype=torch.float32, device=device),
            top_k=torch.full((n,), int(top_k), dtype=torch.int64, device=device),
            top_p=torch.full((n,), float(top_p), dtype=torch.float32, device=device),
            min_p=torch.full((n,), float(min_p), dtype=torch.float32, device=device),
        )

    def select(self, rows: torch.Tensor) -> "SamplingTensors":
        """The rows ``rows`` ([n] int64 indices or [R] bool mask), in that order."""
        return SamplingTensors(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                               self.min_p[rows])

    def repeat_interleave(self, k: int) -> "SamplingTensors":
        """Each row repeated ``k`` times (one row per block position)."""
        return SamplingTensors(*(t.repeat_interleave(k, dim=0) for t in
                                 (self.temperature, self.top_k, self.top_p, self.min_p)))


@dataclass
class DraftBlock:
    """One drafting round for R requests (paper Eq 4, 7).

    tokens:      [R, gamma] int64 draft tokens x_1..x_gamma, sampled left to right.
    probs:       [R, gamma, V] float32 warped draft distributions p_d the tokens were sampled from,
                 or None when every row is one-hot at its tokens (prompt lookup, a greedy round
                 of the compiled drafter; built only if a consumer needs it:
                 ``dense_draft_probs``).
    conf_logits: [R, gamma] float32 raw confidence-head logits (uncalibrated; zeros without a head).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    conf_logits: torch.Tensor


@dataclass
class VerifyResult:
    """Outcome of chain rejection sampling (``dspark_serve.verify.rejection``).

    num_accepted: [R] int64 accepted draft tokens, 0..l_r.
    tokens:       [R, gamma + 1] int64: the accepted drafts, then one recovered (after a
                  rejection) or bonus (all l_r accepted) token; padded with -1.
    num_tokens:   [R] int64 tokens emitted this round = num_accepted + 1.
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor
    num_tokens: torch.Tensor


def dense_draft_probs(tokens: torch.Tensor, probs: torch.Tensor | None,
                      vocab_size: int) -> torch.Tensor:
    """probs, or for None the one-hot distributions [R, gamma, V] float32 at tokens [R, gamma]."""
    if probs is not None:
        return probs
    return torch.nn.functional.one_hot(tokens, vocab_size).to(torch.float32)
