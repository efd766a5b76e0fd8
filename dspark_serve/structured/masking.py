"""Grammar masks inside a speculative round.

A verify block for request r holds the anchor and drafts x_1..x_l. The target logits at block
position j predict the token after x_j, so they are masked by the grammar state after the
committed output *and* x_1..x_j, exactly as one-token-at-a-time decoding would mask them
(the same rule as penalties, ``dspark_serve.verify.penalties``). The state is advanced through
the drafts only to fill these masks and rolled back afterwards; the engine then accepts the
committed tokens one by one. Recovered and bonus tokens are drawn from the masked target, so
a forbidden token is never emitted, and verification stays lossless for the constrained
distribution (rejection sampling is exact for any target row).

Positions that cannot matter are left unmasked (all tokens allowed), never filled from an
invalid state: after a draft the grammar forbids (the target gives it probability 0, so it is
rejected for certain and nothing after it is used), and after a drafted stop token (the
request ends there if it is accepted).

Drafts (``constrain_drafts``, before the target forward): the drafter does not know the
grammar. Walking its block, a forbidden draft ends the verified length right after it (the
rest is certain to be discarded; the outcome distribution is unchanged, only target work is
saved). With ``mask_drafts`` each draft distribution q_k is first restricted to the allowed
tokens and renormalised, and a forbidden x_k is redrawn from it: keeping an allowed draw and
redrawing a forbidden one yields exactly a sample of the masked q_k, so rejection sampling
runs against the distribution the token really came from. Where q_k has no allowed mass
(e.g. a greedy one-hot on a forbidden token) the block ends before x_k: verifying x_k would
reject it for certain and draw the replacement from max(0, p - q_k) = p, the same as a bonus
token one position earlier.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from dspark_serve.sampling.sampler import sample_from_probs
from dspark_serve.structured.compiler import GrammarState

def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32 bitmask with every token allowed (bit t % 32 of word
    t // 32 set = token t allowed; the layout xgrammar fills)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., W] int32 CPU bitmask -> [..., V] bool (CPU), True = allowed.

    numpy's unpackbits over the little-endian bytes: ~10x faster than shifting in torch,
    which matters at every verified position of every constrained request."""
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1,
                         bitorder="little")
    return torch.from_numpy(bits[..., :vocab_size].view(np.bool_))


def verify_bitmask(states: Sequence[GrammarState | None], drafts: torch.Tensor,
                   lengths: Sequence[int], vocab_size: int) -> tuple[torch.Tensor, list[int]]:
    """Allowed tokens at every verify position of R requests.

    Args:
        states: R grammar states (None = unconstrained request), each at its committed output;
            returned at the same state.
        drafts: [R, gamma] int64 (CPU) drafted tokens x_1..x_gamma.
        lengths: R verified draft lengths l_r (rows request-major, l_r + 1 per request).
    Returns:
        (bitmask [sum(l_r + 1), ceil(V / 32)] int32, indices of the rows actually masked).
    """
    offsets, total = [], 0
    for n in lengths:
        offsets.append(total)
        total += int(n) + 1
    bitmask, rows = new_bitmask(total, vocab_size), []
    draft_rows = drafts.tolist()
    for i, state in enumerate(states):
        if state is None:
            continue
        pushed = 0
        for j in range(int(lengths[i]) + 1):
            if state.terminated:
                break
            state.fill(bitmask, offsets[i] + j)
            rows.append(offsets[i] + j)
            if j == lengths[i] or not state.accept(draft_rows[i][j]):
                break
            pushed += 1
        state.rollback(pushed)
    return bitmask, rows


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Logits with forbidden tokens at -inf in ``rows``.

    Args:
        logits: [N, V] float (not modified). bitmask: [N, W] int32 (``verify_bitmask``).
        rows: row indices to mask.
    Returns:
        [N, V] float32 new tensor.
    """
    out = logits.float().clone()
    if rows:
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        allowed = bitmask_to_bool(bitmask[idx.cpu()], logits.shape[1]).to(logits.device)
        out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out


def constrain_drafts(states: Sequence[GrammarState | None], tokens: torch.Tensor,
                     probs: torch.Tensor, lengths: torch.Tensor,
                     uniforms: torch.Tensor | None) -> None:
    """Fit R drafted blocks to their grammars (module docstring), in place.

    Args:
        states: R grammar states at the committed output (None = leave the row alone);
            returned at the same state.
        tokens: [R, gamma] int64 drafts, each drawn from its row of ``probs``; forbidden
            ones are redrawn when ``uniforms`` is given.
        probs: [R, gamma, V] float32 draft distributions; masked and renormalised at the
            verified positions when ``uniforms`` is given.
        lengths: [R] int64 (CPU) verified lengths; shortened where the rest cannot matter.
        uniforms: [R, gamma] float32 in [0, 1) for redraws, or None to verify the drafts as
            drafted (only the lengths change).
    Raises:
        RuntimeError: the grammar refuses a redrawn token (a backend inconsistency).
    """
    vocab = probs.shape[-1]
    for i, state in enumerate(states):
        if state is None or int(lengths[i]) == 0:
            continue
        n = int(lengths[i])
        masks, pushed, kept = new_bitmask(n, vocab), 0, n
        for k in range(n):
            if state.terminated:  # x_k was a stop token: nothing after it is committed
                kept = k
                break
            state.fill(masks, k)
            token = int(tokens[i, k])
            if not _allows(masks[k], token):
                if uniforms is None:  # verified and rejected for certain; the rest unused
                    kept = k + 1
                    break
                # redraw from q restricted to the allowed ids (often a handful: work on those)
                ids = torch.from_numpy(np.flatnonzero(bitmask_to_bool(masks[k], vocab).numpy()))
                ids = ids.to(probs.device)
                weights = probs[i, k, ids]
                if not bool((weights > 0).any()):
                    kept = k
                    break
                token = int(ids[sample_from_probs(weights[None], uniforms[i, k][None])[0]])
                tokens[i, k] = token
            if not state.accept(token):
                raise RuntimeError(f"the grammar refused token {token} it allowed")
            pushed += 1
        if uniforms is not None and pushed:
            # one batched renormalisation of the masked q at the kept positions that need it
            # (a one-hot on an allowed token, e.g. a greedy draft, is its own masked q)
            own = probs[i, :pushed].gather(-1, tokens[i, :pushed, None]).flatten()
            rows = (own < 1.0).nonzero().flatten()
            if rows.numel():
                allowed = bitmask_to_bool(masks[rows.cpu()], vocab).to(probs.device)
                q = probs[i, rows].masked_fill_(~allowed, 0.0)
                probs[i, rows] = q.div_(q.sum(dim=-1, keepdim=True))
        lengths[i] = kept
        state.rollback(pushed)


def _allows(mask_row: torch.Tensor, token: int) -> bool:
    """Bit ``token`` of one [W] int32 bitmask row."""
    return bool((int(mask_row[token >> 5]) >> (token & 31)) & 1)
