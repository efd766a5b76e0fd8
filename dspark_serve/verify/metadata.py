"""Where one step's verified rows sit in the target's output, computed once per step.

A step verifies R rows: every decoding request (its anchor and l_r drafts) and every request
whose prompt completes this step (l = 0: its last prompt token's logits give the first output
token). Row r owns the l_r + 1 logit rows ``offsets[r] .. offsets[r] + l_r`` of the forward's
output (N = sum(l_r + 1) rows in all); logit row ``offsets[r] + j`` is the target's prediction
after block position j of row r, computed at flat token ``first_token[r] + j``.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass(frozen=True)
class SpecMetadata:
    """Layout of one step's R verify rows and N = sum(l_r + 1) logit rows.

    gamma:          draft positions of this step's blocks (0 when nothing was drafted).
    lengths:        [R] verified draft lengths l_r (Python ints).
    offsets:        [R] first logit row of each verify row (Python ints).
    verify_lengths: [R] int64 l_r on the device.
    logit_indices:  [N] int64 flat token index whose logits the forward computes.
    logit_rows:     [N] int64 verify row r of each logit row.
    logit_cols:     [N] int64 block position j (0..l_r) of each logit row.
    drafts:         [R, gamma] int64 draft tokens (zeros for rows with l = 0 by construction).
    draft_probs:    [R, gamma, V] float32 draft distributions, or None: one-hot at the drafts
                    (prompt lookup's, or nothing drafted when gamma is 0).
    """

    gamma: int
    lengths: list[int]
    offsets: list[int]
    verify_lengths: torch.Tensor
    logit_indices: torch.Tensor
    logit_rows: torch.Tensor
    logit_cols: torch.Tensor
    drafts: torch.Tensor
    draft_probs: torch.Tensor | None

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @classmethod
    def build(cls, first_token: list[int], lengths: list[int], drafts: torch.Tensor,
              draft_probs: torch.Tensor | None, gamma: int,
              device: torch.device | str) -> "SpecMetadata":
        """Metadata of R verify rows.

        Args:
            first_token: [R] flat token index of each row's first verified position (the
                anchor of a decoding request, the last prompt token of a completed prefill).
            lengths: [R] l_r.
            drafts, draft_probs: as the fields (already on ``device``).
            gamma: draft positions.
            device: where the index tensors live (one host-to-device copy for all of them).
        """
        sizes = [n + 1 for n in lengths]
        offsets = [0, *accumulate(sizes)][:-1]
        rows = [r for r, size in enumerate(sizes) for _ in range(size)]
        cols = [j for size in sizes for j in range(size)]
        indices = [first_token[r] + j for r, j in zip(rows, cols)]
        n, r = len(rows), len(lengths)
        packed = torch.tensor(lengths + indices + rows + cols, dtype=torch.int64).to(device)
        verify_lengths, logit_indices, logit_rows, logit_cols = packed.split([r, n, n, n])
        return cls(gamma, list(lengths), offsets, verify_lengths, logit_indices, logit_rows,
                   logit_cols, drafts, draft_probs)
