"""Chain rejection sampling over variable-length draft prefixes (paper Section 2.1, 3.2.2).

Terms, for request r with scheduled verification length l_r in 0..gamma:

- accepted tokens: drafts x_1..x_n, the longest prefix of x_1..x_{l_r} that passes the
  test u_k < p_t,k(x_k) / p_d,k(x_k), checked left to right (n = num_accepted, tau - 1);
- recovered token: after the first rejection at position n < l_r, one token drawn from
  the residual norm(max(0, p_t,n - p_d,n)); drafts after it are discarded;
- bonus token: when all l_r drafts are accepted, one token drawn from p_t at position l_r
  (the target's distribution after the last accepted draft).

By the rejection sampling theorem (Leviathan et al. 2023, Theorem 1; Chen et al. 2023) each
emitted token is distributed exactly as the target's warped distribution p_t at its position,
so the output is lossless for any drafter, provided l_r is non-anticipating: the decision
l_r >= k may depend on x_1..x_{k-1} but not on x_k or later (paper Section 3.2.2, Appendix).
l_r = 0 reduces to ordinary sampling from p_t at position 0. Greedy rows (one-hot p_t)
reduce to the longest prefix matching the target argmax plus the argmax correction/bonus.
"""
from __future__ import annotations

import torch

from dspark_serve.sampling.sampler import sample_from_probs
from dspark_serve.types import VerifyResult

PAD_TOKEN = -1


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor, lengths: torch.Tensor,
                     u_accept: torch.Tensor, u_final: torch.Tensor) -> VerifyResult:
    """Verify R draft blocks of per-request length l_r in one vectorised pass.

    Row r reads only target positions 0..l_r and draft positions 0..l_r-1; entries beyond
    them (padding, garbage, NaN) are ignored.

    Args:
        target_probs: [R, gamma+1, V] float32 warped target distributions; position k is
            the target's distribution for the token after drafts x_1..x_k.
        draft_tokens: [R, gamma] int64 draft tokens x_1..x_gamma.
        draft_probs: [R, gamma, V] float32 warped draft distributions the tokens were drawn from.
        lengths: [R] int64 scheduled verification lengths l_r in 0..gamma.
        u_accept: [R, gamma] float32 uniforms in [0, 1) for the accept tests.
        u_final: [R] float32 uniform in [0, 1) for the recovered or bonus token.

    Returns:
        ``VerifyResult``: num_accepted [R] int64 in 0..l_r; tokens [R, gamma+1] int64 with the
        accepted drafts, then the recovered/bonus token, then -1 padding; num_tokens [R]
        int64 = num_accepted + 1.

    Raises:
        ValueError: mismatched shapes, dtypes or devices, a length outside 0..gamma, or a
            verified draft token outside 0..V-1.
    """
    _check(target_probs, draft_tokens, draft_probs, lengths, u_accept, u_final)
    num_req, gamma = draft_tokens.shape
    device = target_probs.device
    positions = torch.arange(gamma, device=device)
    verified = positions[None, :] < lengths[:, None]                      # [R, gamma]

    tokens_idx = torch.where(verified, draft_tokens, 0).unsqueeze(-1)
    p_target = target_probs[:, :gamma].gather(-1, tokens_idx).squeeze(-1)
    p_draft = draft_probs.gather(-1, tokens_idx).squeeze(-1)
    # IEEE division gives the intended limits: p_t>0, p_d=0 -> inf (accept); 0/0 -> NaN (reject).
    accept = (u_accept < p_target / p_draft) & verified
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)                # [R]

    rows = torch.arange(num_req, device=device)
    rejected = num_accepted < lengths
    final_target = target_probs[rows, num_accepted]                       # [R, V]
    # p_d at the rejected position; rows without a rejection (num_accepted may equal gamma)
    # read a clamped, unused row.
    final_draft = (draft_probs[rows, num_accepted.clamp(max=gamma - 1)] if gamma
                   else torch.zeros_like(final_target))
    residual = (final_target - final_draft).clamp(min=0)
    # p_t == p_d can still reject through float rounding of the ratio; the residual is then
    # empty and p_t itself is the correct (measure-zero) fallback.
    use_residual = rejected & (residual.sum(dim=-1) > 0)
    final_probs = torch.where(use_residual[:, None], residual, final_target)
    final_token = sample_from_probs(final_probs, u_final)

    out = torch.full((num_req, gamma + 1), PAD_TOKEN, dtype=torch.int64, device=device)
    out[:, :gamma] = torch.where(positions[None, :] < num_accepted[:, None], draft_tokens, PAD_TOKEN)
    out.scatter_(1, num_accepted[:, None], final_token[:, None])
    return VerifyResult(num_accepted=num_accepted, tokens=out, num_tokens=num_accepted + 1)


def _check(target_probs, draft_tokens, draft_probs, lengths, u_accept, u_final) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [R, gamma], got {tuple(draft_tokens.shape)}")
    num_req, gamma = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (num_req, gamma + 1):
        raise ValueError(f"target_probs must be [{num_req}, {gamma + 1}, V], "
                         f"got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[2]
    expected = {"target_probs": (target_probs, (num_req, gamma + 1, vocab), torch.float32),
                "draft_tokens": (draft_tokens, (num_req, gamma), torch.int64),
                "draft_probs": (draft_probs, (num_req, gamma, vocab), torch.float32),
                "lengths": (lengths, (num_req,), torch.int64),
                "u_accept": (u_accept, (num_req, gamma), torch.float32),
                "u_final": (u_final, (num_req,), torch.float32)}
    for name, (t, shape, dtype) in expected.items():
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != target_probs.device:
            raise ValueError(f"{name} must be {dtype} {list(shape)} on {target_probs.device}, "
                             f"got {t.dtype} {list(t.shape)} on {t.device}")
    verified = torch.arange(gamma, device=lengths.device)[None, :] < lengths[:, None]
    bad_length, bad_token = torch.stack([
        ((lengths < 0) | (lengths > gamma)).any(),
        (verified & ((draft_tokens < 0) | (draft_tokens >= vocab))).any()]).tolist()
    if bad_length:
        raise ValueError(f"lengths must be in 0..{gamma}, got {lengths.tolist()}")
    if bad_token:
        raise ValueError(f"verified draft tokens must be in 0..{vocab - 1}")
