"""Training losses of the drafter (paper Section 3.3, Eq 8-12), written like the equations.

For block r and draft position k = 1..gamma, with p^d_k the drafter's distribution (Eq 4, the
sequential head's bias included, teacher-forced on the true prefix) and p^t_k the frozen
target's distribution for the same token, both warped at the training temperature T
(p = softmax(logits / T), the warping the verifier applies at serving temperature T):

    w_k       = exp(-(k - 1) / decay)                                  position weights
    c*_k      = 1 - 1/2 ||p^d_k - p^t_k||_1        (detached)          Eq 8, acceptance label
    L_ce      = -sum_k w_k log p^d_k(x*_k)          (unwarped, T = 1)  Eq 10
    L_tv      =  sum_k w_k ||p^d_k - p^t_k||_1                          Eq 11
    L_conf    = -sum_k w_k [c*_k log c_k + (1 - c*_k) log(1 - c_k)]    Eq 12, c_k = sigmoid(z_k)
    L         = alpha_ce L_ce + alpha_tv L_tv + alpha_conf L_conf       Eq 9

The paper writes per-block sums; like DeepSpec (``deepspec/modeling/dspark/loss.py``) each term
here is averaged over the supervised (block, position) pairs with the same weights,
sum_{r,k} w_k m_{r,k} l_{r,k} / sum_{r,k} w_k m_{r,k}, where m masks labels past the response;
this only rescales the terms by a constant and keeps the learning rate batch-size free.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ALPHA_CE, ALPHA_TV, ALPHA_CONF = 0.1, 0.9, 1.0


def position_weights(gamma: int, decay: float) -> torch.Tensor:
    """w_k = exp(-(k - 1) / decay) for k = 1..gamma: [gamma] float32. ValueError if decay <= 0."""
    if not decay > 0:
        raise ValueError(f"loss decay must be > 0, got {decay}")
    return torch.exp(-torch.arange(gamma, dtype=torch.float32) / decay)


def warped_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32 over the last dim (temperature-only warping).
    ValueError for T <= 0: greedy one-hot distributions have no gradient."""
    if not temperature > 0:
        raise ValueError(f"training temperature must be > 0, got {temperature}")
    return torch.softmax(logits.float() / temperature, dim=-1)


def acceptance_label(p_draft: torch.Tensor, p_target: torch.Tensor) -> torch.Tensor:
    """Eq 8: c* = 1 - 1/2 ||p_d - p_t||_1 over the last dim, detached, clamped to [0, 1]."""
    return (1.0 - 0.5 * (p_draft - p_target).abs().sum(-1)).detach().clamp(0.0, 1.0)


@dataclass
class LossTerms:
    """Scalar float32 losses (``total`` carries the graph) and detached diagnostics.

    accept: [gamma] mean c*_k over supervised blocks (NaN where none); expected_tau: mean over
    blocks of 1 + sum_k prod_{i<=k} c*_i, the accepted length rejection sampling would give in
    expectation for full-length verification (DeepSpec's ``tau_probabilistic``).
    """

    total: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    conf: torch.Tensor
    accept: torch.Tensor
    expected_tau: float


def _weighted_mean(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (per_token * weights).sum() / weights.sum().clamp_min(1e-12)


def drafter_loss(draft_logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, *,
                 target_logits: torch.Tensor | None = None, conf_logits: torch.Tensor | None = None,
                 alpha_ce: float = ALPHA_CE, alpha_tv: float = ALPHA_TV,
                 alpha_conf: float = ALPHA_CONF, decay: float,
                 temperature: float = 1.0) -> LossTerms:
    """Eq 9 for R blocks.

    Args:
        draft_logits: [R, gamma, V] float, U_k + B_k (unwarped).
        labels: [R, gamma] int64 x*_k; label_mask: [R, gamma] bool supervised positions.
        target_logits: [R, gamma, V] float target logits for the same tokens; required when
            alpha_tv > 0 or a confidence term is trained.
        conf_logits: [R, gamma] float z_k of the confidence head, or None (no head: no L_conf).
        alpha_*: Eq 9 weights; decay: position weight decay; temperature: training T > 0.
    Returns:
        ``LossTerms`` (terms that are off are 0).
    Raises:
        ValueError: shape mismatches, or target logits missing where needed.
    """
    r, gamma, vocab = draft_logits.shape
    if labels.shape != (r, gamma) or label_mask.shape != (r, gamma):
        raise ValueError(f"labels/label_mask must be [{r}, {gamma}], got {tuple(labels.shape)} "
                         f"and {tuple(label_mask.shape)}")
    use_conf = conf_logits is not None and alpha_conf != 0
    if target_logits is None and (alpha_tv != 0 or use_conf):
        raise ValueError("target_logits are needed for the TV and confidence terms")
    if target_logits is not None and target_logits.shape != draft_logits.shape:
        raise ValueError(f"target_logits {tuple(target_logits.shape)} != draft_logits "
                         f"{tuple(draft_logits.shape)}")
    w = position_weights(gamma, decay).to(draft_logits.device) * label_mask.float()
    zero = draft_logits.new_zeros((), dtype=torch.float32)
    nll = F.cross_entropy(draft_logits.float().reshape(-1, vocab), labels.reshape(-1),
                          reduction="none").view(r, gamma)
    ce = _weighted_mean(nll, w)
    tv, conf = zero, zero
    accept = torch.full((gamma,), float("nan"))
    expected_tau = float("nan")
    if target_logits is not None:
        p_d = warped_probs(draft_logits, temperature)
        p_t = warped_probs(target_logits, temperature)
        l1 = (p_d - p_t).abs().sum(-1)                                   # [R, gamma]
        tv = _weighted_mean(l1, w)
        c_star = acceptance_label(p_d, p_t)
        if use_conf:
            bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
            conf = _weighted_mean(bce, w)
        with torch.no_grad():
            m = label_mask.float()
            accept = (c_star * m).sum(0) / m.sum(0)
            blocks = label_mask[:, 0]
            if bool(blocks.any()):
                expected_tau = float((1 + torch.cumprod(c_star * m, 1).sum(1))[blocks].mean())
    total = alpha_ce * ce + alpha_tv * tv + (alpha_conf * conf if use_conf else zero)
    return LossTerms(total=total, ce=ce.detach(), tv=tv.detach(), conf=conf.detach(),
                     accept=accept.cpu(), expected_tau=expected_tau)
