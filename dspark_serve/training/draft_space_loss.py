"""Eq 8-12 with a pruned draft vocabulary (issue 15): the drafter's distribution lives on N
draft tokens (exactly 0 elsewhere), the target's on all V.

With D the draft vocabulary, p_d over D, p_t over V (at T = 1) and o_t = sum_{v not in D}
p_t(v) the target mass outside D:

    ||p_d - p_t||_1 = sum_{v in D} |p_d(v) - p_t(v)| + o_t        (TV over the full vocabulary)
    c*_k            = 1 - 1/2 ||p_d - p_t||_1                        Eq 8 (detached)
    L_ce            = -sum_k w_k log p_d(g_k)     g_k the target's greedy token, only where
                                                  g_k is in D (elsewhere no token can match)
    L_tv, L_conf, L as ``losses`` (Eq 9, 11, 12), averaged over supervised (block, position)
    pairs with weights w_k = exp(-(k - 1) / decay).

The CE label is the target's own greedy token (not the text's next token): ShareGPT answers are
not the target's outputs, and at T = 0 a draft is accepted iff it is that token. p_t(v) on D
is exp(f_t . W_v - lse_t) from the cached final hidden state and full-vocabulary log-normaliser
(``feature_cache``), so o_t is exact up to float32 rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark_serve.training.losses import (ALPHA_CE, ALPHA_CONF, ALPHA_TV, LossTerms,
                                          position_weights)


def draft_space_loss(logits: torch.Tensor, target_probs: torch.Tensor, greedy: torch.Tensor,
                     label_mask: torch.Tensor, *, conf_logits: torch.Tensor | None = None,
                     alpha_ce: float = ALPHA_CE, alpha_tv: float = ALPHA_TV,
                     alpha_conf: float = ALPHA_CONF, decay: float,
                     normalizer: torch.Tensor | None = None) -> tuple[LossTerms, torch.Tensor]:
    """Eq 9 over R blocks in draft space.

    Args:
        logits: [R, gamma, N] float32 draft logits (U_k + B_k) over the draft vocabulary.
        target_probs: [R, gamma, N] float32 p_t on the draft vocabulary (sums to 1 - o_t <= 1).
        greedy: [R, gamma] int64 draft index of the target's greedy token, -1 when it is
            outside the draft vocabulary.
        label_mask: [R, gamma] bool supervised positions.
        conf_logits: [R, gamma] float32 confidence logits, or None (no L_conf).
        alpha_*: Eq 9 weights; decay: position weight decay (> 0).
        normalizer: optional scalar: divide weighted sums by this instead of this batch's
            weight sum (a step split over several calls then averages over the whole step).
    Returns:
        (``LossTerms``; ``accept`` is the mean c*_k), and match [R, gamma] bool: argmax p_d is
        the target's greedy token (T = 0 acceptance of position k given the true prefix).
    Raises:
        ValueError: shape mismatch.
    """
    r, gamma, n = logits.shape
    if target_probs.shape != logits.shape or greedy.shape != (r, gamma) or \
            label_mask.shape != (r, gamma):
        raise ValueError(f"target_probs must be [{r}, {gamma}, {n}] and greedy/label_mask "
                         f"[{r}, {gamma}], got {tuple(target_probs.shape)}, "
                         f"{tuple(greedy.shape)}, {tuple(label_mask.shape)}")
    w = position_weights(gamma, decay).to(logits.device) * label_mask.float()
    inside = greedy >= 0
    w_ce = w * inside.float()
    norm_tv = w.sum().clamp_min(1e-12) if normalizer is None else normalizer
    norm_ce = w_ce.sum().clamp_min(1e-12) if normalizer is None else normalizer
    outside = (1.0 - target_probs.sum(-1)).clamp_min(0.0)
    l1, nll = _L1AndNLL.apply(logits.reshape(-1, n), target_probs.reshape(-1, n),
                              outside.reshape(-1), greedy.clamp_min(0).reshape(-1))
    l1, nll = l1.view(r, gamma), nll.view(r, gamma)
    ce = (nll * w_ce).sum() / norm_ce
    tv = (l1 * w).sum() / norm_tv
    c_star = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
    zero = logits.new_zeros(())
    use_conf = conf_logits is not None and alpha_conf != 0
    conf = zero
    if use_conf:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
        conf = (bce * w).sum() / norm_tv
    total = alpha_ce * ce + alpha_tv * tv + (alpha_conf * conf if use_conf else zero)
    with torch.no_grad():
        m = label_mask.float()
        accept = (c_star * m).sum(0) / m.sum(0)
        blocks = label_mask[:, 0]
        expected_tau = float((1 + torch.cumprod(c_star * m, 1).sum(1))[blocks].mean()) \
            if bool(blocks.any()) else float("nan")
        match = (logits.detach().argmax(-1) == greedy) & inside
    return LossTerms(total=total, ce=ce.detach(), tv=tv.detach(), conf=conf.detach(),
                     accept=accept.cpu(), expected_tau=expected_tau), match


class _L1AndNLL(torch.autograd.Function):
    """Per row of M rows: ||softmax(z) - q||_1 + o and -log softmax(z)[g], with a hand-written
    backward (d/dz ||p - q||_1 = p * (s - <p, s>), s = sign(p - q)) that makes about a third of
    the passes over the [M, N] arrays autograd would (issue 15: the loss was a fifth of a
    step).

    forward(z [M, N] float (logits), q [M, N] float32 (target probs on the draft vocabulary),
    o [M] float32 (target mass outside it), g [M] int64) -> (l1 [M], nll [M]).
    No gradient reaches q, o or g (the target is frozen). The backward reuses its saved
    buffer: call it once (no retain_graph).
    """

    @staticmethod
    def forward(ctx, z, q, o, g):
        z = z.float()
        lse = torch.logsumexp(z, dim=-1)
        p = (z - lse[:, None]).exp_()
        s = p - q
        l1 = torch.linalg.vector_norm(s, ord=1, dim=-1) + o
        nll = lse - z.gather(1, g[:, None]).squeeze(1)
        ctx.save_for_backward(p, s.sign_(), g)
        return l1, nll

    @staticmethod
    def backward(ctx, grad_l1, grad_nll):
        p, s, g = ctx.saved_tensors
        # in place on the saved sign: p * (a (s - <p, s>) + b); fresh [M, N] buffers cost
        # page faults on the CPU
        ps = torch.linalg.vecdot(p, s)[:, None]
        grad = s.sub_(ps).mul_(grad_l1[:, None]).add_(grad_nll[:, None]).mul_(p)
        grad.scatter_add_(1, g[:, None], -grad_nll[:, None])
        return grad, None, None, None
