"""The target side of a speculative step: from the forward's logit rows to committed tokens.

At every verified position the target distribution is built exactly as one-token-at-a-time
decoding would build it: penalties and logit bias with the drafted history
(``verify.penalties``), the grammar mask after the drafted tokens (``structured.masking``),
then warping (``sampling.warping``). Seeded rows are replayed (``verify.seeded``); chain
rejection sampling (``verify.rejection``) then accepts a prefix of each block and draws the
recovered or bonus token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dspark_serve.sampling.argmax import row_argmax
from dspark_serve.sampling.sampler import draw_uniforms
from dspark_serve.sampling.warping import GREEDY_TEMPERATURE, warp_probs
from dspark_serve.structured.compiler import GrammarState
from dspark_serve.structured.masking import mask_logits, verify_bitmask
from dspark_serve.types import SamplingTensors, dense_draft_probs
from dspark_serve.verify.metadata import SpecMetadata
from dspark_serve.verify.penalties import PenaltyState, apply_penalties, block_history_counts
from dspark_serve.verify.rejection import rejection_sample
from dspark_serve.verify.seeded import replay_seeded


@dataclass(frozen=True)
class SamplingBatch:
    """Sampling inputs of the R verify rows of one step, built once per step.

    sampling:   [R] warping parameters (also the drafter's, for the decoding rows).
    penalties:  [R, V] penalty inputs, or None when no row has any.
    generators: [R] each row's random stream (its own when seeded, else the engine's).
    seeds:      [R] seed of each row, None for rows without one (replayed, ``verify.seeded``).
    num_output: [R] output tokens committed before this step.
    grammars:   [R] grammar state at the committed output, None for unconstrained rows.
    """

    sampling: SamplingTensors
    penalties: PenaltyState | None
    generators: list[torch.Generator]
    seeds: list[int | None]
    num_output: list[int]
    grammars: list[GrammarState | None]

    @classmethod
    def plain(cls, sampling: SamplingTensors, generators: list[torch.Generator]) -> "SamplingBatch":
        """Rows without penalties, seeds or grammars (e.g. ``eval.rounds``)."""
        n = len(generators)
        return cls(sampling, None, generators, [None] * n, [0] * n, [None] * n)


@dataclass(frozen=True)
class Verdict:
    """Tokens committed per verify row: ``tokens[r]`` holds row r's accepted drafts, then the
    recovered or bonus token (``num_accepted[r] + 1`` tokens). grammar_seconds: time spent
    masking logits."""

    tokens: list[list[int]]
    num_accepted: list[int]
    grammar_seconds: float = 0.0


class TargetSampler:
    """Penalties, grammar masks, warping, seeded replay and rejection sampling for one step.

    Args:
        vocab_size: V.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def verify(self, logits: torch.Tensor, meta: SpecMetadata, batch: SamplingBatch) -> Verdict:
        """Verify one step's rows.

        Args:
            logits: [N, V] float raw target logits, N = sum(l_r + 1) in ``meta`` order.
            meta: the step's layout; batch: the rows' sampling inputs.
        Returns:
            the committed tokens (one device-to-host copy for the whole step).
        """
        if not meta.num_rows:  # only prefill chunks that do not complete their prompt
            return Verdict([], [])
        g, d = meta.gamma, logits.device
        rows, lengths = meta.logit_rows, meta.verify_lengths
        if batch.penalties is not None:
            history = block_history_counts(meta.drafts, lengths, self.vocab_size) if g else None
            logits = apply_penalties(logits, rows, batch.penalties, history)
        grammar_seconds = 0.0
        if any(s is not None for s in batch.grammars):
            start = time.perf_counter()
            bitmask, masked = verify_bitmask(batch.grammars, meta.drafts.cpu(), meta.lengths,
                                             self.vocab_size)
            logits = mask_logits(logits, bitmask, masked)
            grammar_seconds = time.perf_counter() - start
        if bool((batch.sampling.temperature < GREEDY_TEMPERATURE).all()):
            num_accepted, tokens = greedy_verify(logits, meta)
        else:
            probs = warp_probs(logits, batch.sampling.select(rows))
            # dense [R, gamma + 1, V] rows for rejection sampling; unused positions stay zero
            target_probs = probs.new_zeros(meta.num_rows, g + 1, self.vocab_size)
            target_probs[rows, meta.logit_cols] = probs
            replay_seeded(target_probs, batch.seeds, batch.num_output, meta.lengths)
            draft_probs = dense_draft_probs(meta.drafts, meta.draft_probs, self.vocab_size)
            u = draw_uniforms(batch.generators, g + 1, d)
            result = rejection_sample(target_probs, meta.drafts, draft_probs, lengths,
                                      u[:, :g].contiguous(), u[:, g].contiguous())
            num_accepted, tokens = result.num_accepted, result.tokens
        packed = torch.cat([num_accepted[:, None], tokens], 1).tolist()
        return Verdict([row[1:row[0] + 2] for row in packed], [row[0] for row in packed],
                       grammar_seconds)


def greedy_verify(logits: torch.Tensor, meta: SpecMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification when every row is greedy: the target's distribution at each position is
    one-hot at the argmax of its (processed) logits, so rejection sampling accepts a draft iff
    it equals that argmax and draws the argmax at the first rejection or as the bonus token,
    whatever the draft probabilities (``rejection_sample`` gives the same tokens, uniforms
    unused). No [R, gamma + 1, V] buffers and no random draws.

    Args:
        logits: [N, V] processed target logits in ``meta`` order.
    Returns:
        (num_accepted [R] int64, tokens [R, gamma + 1] int64: the accepted drafts, then the
        argmax after them; positions past it are undefined), as ``VerifyResult``.
    """
    g = meta.gamma
    best = logits.new_zeros(meta.num_rows, g + 1, dtype=torch.int64)
    best[meta.logit_rows, meta.logit_cols] = row_argmax(logits)
    verified = torch.arange(g, device=logits.device)[None, :] < meta.verify_lengths[:, None]
    match = (meta.drafts == best[:, :g]) & verified
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    tokens = torch.cat([meta.drafts, best[:, -1:]], dim=1)
    # the argmax at the first rejected position (or the bonus position) follows the accepted
    tokens.scatter_(1, num_accepted[:, None], best.gather(1, num_accepted[:, None]))
    return num_accepted, tokens
