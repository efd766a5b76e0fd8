"""Offline drafter metrics over recorded rounds (paper Section 4.2-4.3, Table 1, Figures 2, 5, 6).

- accepted length tau: tokens committed per verify round, the bonus or recovered token
  included (tau = n + 1 for n accepted drafts), averaged over rounds;
- position-wise conditional acceptance (Figure 2): P(n >= k | n >= k - 1), the denominator
  being the rounds whose drafts 1..k-1 were all accepted;
- static-threshold sweep (Figure 5): with threshold t each round verifies only the prefix before
  the first calibrated c_k < t (``ThresholdScheduler``); drafts 1..l keep the outcome they had
  under full verification (chain rejection sampling decides token k from tokens 1..k only), so
  accepted = min(n, l). Reported: acceptance rate sum(accepted) / sum(l) and tokens per round
  mean(min(n, l) + 1);
- calibration (Figure 6): ECE / AUROC / Brier per position of the prefix survival
  a_k = prod_{i<=k} sigmoid(z_i / T_i) against "drafts 1..k accepted", raw (T = 1) and with STS.
"""
from __future__ import annotations

import math

import torch

from dspark_serve.calibration.metrics import per_position_metrics
from dspark_serve.calibration.sts import calibrated_confidence, prefix_survival_labels
from dspark_serve.scheduling.static import ThresholdScheduler

DEFAULT_THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def accepted_length(num_accepted: torch.Tensor) -> float:
    """tau = mean(n + 1) over rounds ([N] int64); NaN without rounds."""
    return float((num_accepted.double() + 1).mean()) if num_accepted.numel() else math.nan


def conditional_acceptance(num_accepted: torch.Tensor, gamma: int) -> list[float]:
    """[gamma] P(n >= k | n >= k - 1) for k = 1..gamma (NaN where no round reached k)."""
    reached = [(num_accepted >= k).sum().item() for k in range(gamma + 1)]
    return [reached[k] / reached[k - 1] if reached[k - 1] else math.nan
            for k in range(1, gamma + 1)]


def threshold_sweep(conf_logits: torch.Tensor, num_accepted: torch.Tensor,
                    temperatures: torch.Tensor | None = None,
                    thresholds=DEFAULT_THRESHOLDS) -> list[dict]:
    """Per threshold: ``threshold``, ``acceptance_rate``, ``tokens_per_round`` and
    ``verified_per_round`` (see module docstring) from full-gamma rounds
    (conf_logits [N, gamma], num_accepted [N]); temperatures: STS [gamma] (None = 1)."""
    gamma = conf_logits.shape[1]
    temps = torch.ones(gamma) if temperatures is None else temperatures.float().cpu()
    c = calibrated_confidence(conf_logits.float(), temps)
    out = []
    for t in thresholds:
        lengths = ThresholdScheduler(gamma, threshold=float(t))(c)
        kept = torch.minimum(num_accepted, lengths)
        verified = int(lengths.sum())
        out.append({"threshold": float(t),
                    "acceptance_rate": kept.sum().item() / verified if verified else math.nan,
                    "tokens_per_round": accepted_length(kept),
                    "verified_per_round": float(lengths.double().mean())})
    return out


def calibration_metrics(conf_logits: torch.Tensor, num_accepted: torch.Tensor,
                        temperatures: torch.Tensor | None = None) -> dict:
    """ECE / AUROC / Brier per position and their means, raw and (given STS temperatures) after
    STS: {"raw": {...}, "sts": {...} or None}; each {"ece", "auroc", "brier": [gamma] lists,
    "mean_ece", "mean_auroc", "mean_brier"} (means over positions with a value)."""
    gamma = conf_logits.shape[1]
    survived, valid = prefix_survival_labels(num_accepted, torch.full_like(num_accepted, gamma),
                                             gamma)
    z = conf_logits.double()

    def report(temps: torch.Tensor) -> dict:
        survival = torch.cumprod(calibrated_confidence(z, temps.double()), dim=1)
        m = per_position_metrics(survival, survived, valid)
        res = {}
        for name in ("ece", "auroc", "brier"):
            values = getattr(m, name).tolist()
            finite = [v for v in values if not math.isnan(v)]
            res[name] = values
            res[f"mean_{name}"] = sum(finite) / len(finite) if finite else math.nan
        return res

    return {"raw": report(torch.ones(gamma, dtype=torch.float64)),
            "sts": report(temperatures.cpu()) if temperatures is not None else None}
