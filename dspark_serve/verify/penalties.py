"""Penalties and logit bias at every verified position, as if decoding one token at a time.

A verify block for request r holds the anchor and drafts d_1..d_l. The target logits at block
position j predict the token after d_j, so the output history seen there is the committed output
plus d_1..d_j. Applying penalties with that history (not the history at the start of the round,
a known gap of other engines) makes the target distribution at each position exactly the one
non-speculative decoding would use. Semantics follow vLLM / OpenAI:

- repetition penalty (prompt and output tokens): logit / p if logit > 0 else logit * p
- frequency penalty: logit -= f * count in output;  presence penalty: logit -= p * [count > 0]
- logit bias: logit += bias[token]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyState:
    """Per-request penalty inputs for one step (R requests, V vocabulary).

    output_counts: [R, V] float32 occurrences of each token in the committed output.
    prompt_mask:   [R, V] bool tokens present in the prompt (for the repetition penalty).
    frequency:     [R] float32;  presence: [R] float32;  repetition: [R] float32 (1 = off).
    logit_bias:    [R, V] float32 additive bias, or None when no request has one.
    """

    output_counts: torch.Tensor
    prompt_mask: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor
    logit_bias: torch.Tensor | None = None

    def active(self) -> bool:
        """True when any penalty changes the logits."""
        return bool((self.frequency != 0).any() or (self.presence != 0).any()
                    or (self.repetition != 1).any())


def block_history_counts(drafts: torch.Tensor, lengths: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts of drafted tokens before each verify position.

    Args:
        drafts: [R, gamma] int64 draft tokens d_1..d_gamma.
        lengths: [R] int64 verified draft lengths l_r.
        vocab_size: V.
    Returns:
        [sum(l_r + 1), V] float32; row (r, j) (flattened request-major, j = 0..l_r) counts
        d_1..d_j of request r.
    """
    R, gamma = drafts.shape
    j = torch.arange(gamma + 1, device=drafts.device)
    valid_pos = j[None, :] <= lengths[:, None]                      # [R, gamma+1]
    row_of = torch.cumsum(valid_pos.flatten(), 0).view(R, gamma + 1) - 1
    counts = torch.zeros(int(valid_pos.sum()), vocab_size, dtype=torch.float32, device=drafts.device)
    i = torch.arange(gamma, device=drafts.device)
    # pair (r, j, i) contributes d_{i+1} to position j when i < j <= l_r
    pair = (i[None, None, :] < j[None, :, None]) & valid_pos[:, :, None]   # [R, gamma+1, gamma]
    r_idx, j_idx, i_idx = pair.nonzero(as_tuple=True)
    counts.index_put_((row_of[r_idx, j_idx], drafts[r_idx, i_idx]),
                      torch.ones(r_idx.numel(), device=drafts.device), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, row_request: torch.Tensor, state: PenaltyState,
                    block_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Penalised logits for N positions.

    Args:
        logits: [N, V] float32 raw target logits.
        row_request: [N] int64 request index (into the R rows of ``state``) of each position.
        state: per-request penalty inputs.
        block_counts: [N, V] float32 drafted tokens before each position (``block_history_counts``),
            or None for positions with no drafted history.
    Returns:
        [N, V] float32 new tensor (the input is not modified).
    """
    out = logits.float().clone()
    if state.active():
        counts = state.output_counts.index_select(0, row_request)
        if block_counts is not None:
            counts = counts + block_counts
        seen = counts > 0
        rep = state.repetition.index_select(0, row_request)[:, None]
        in_ctx = seen | state.prompt_mask.index_select(0, row_request)
        out = torch.where(in_ctx, torch.where(out > 0, out / rep, out * rep), out)
        out -= state.frequency.index_select(0, row_request)[:, None] * counts
        out -= state.presence.index_select(0, row_request)[:, None] * seen.float()
    if state.logit_bias is not None:
        out += state.logit_bias.index_select(0, row_request)
    return out
