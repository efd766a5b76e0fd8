"""Calibration and discrimination metrics for confidence-head survival estimates (paper Section
4.3.3, Figure 6): ECE, AUROC and Brier score, per draft position, and the reliability diagram.

Shape symbols: N samples (drafting rounds), gamma block size, G columns scored at once
(e.g. the STS temperature grid), B bins. Predictions are survival probabilities in [0, 1];
labels are bool (the prefix 1..k survived verification).

ECE uses ``num_bins`` equal-width bins: bin b holds p with floor(p * B) == b, i.e. [b/B, (b+1)/B),
and p == 1 joins the last bin (the rule SGLang's fitter uses). It is weighted by bin counts:
ECE = sum_b n_b / N * |mean_p(b) - mean_y(b)| = (1/N) sum_b |sum_{i in b} (p_i - y_i)|.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_NUM_BINS = 15


def _check_probs_labels(probs: torch.Tensor, labels: torch.Tensor, *, scores: bool = False) -> None:
    if labels.dtype != torch.bool:
        raise TypeError(f"labels must be a bool tensor, got {labels.dtype}")
    if probs.shape[: labels.dim()] != labels.shape:
        raise ValueError(f"prediction shape {tuple(probs.shape)} does not match labels "
                         f"shape {tuple(labels.shape)}")
    if not probs.is_floating_point():
        raise TypeError(f"predictions must be a float tensor, got {probs.dtype}")
    if torch.isnan(probs).any():
        raise ValueError("predictions contain NaN")
    if not scores and ((probs < 0) | (probs > 1)).any():
        raise ValueError("probabilities must lie in [0, 1]")


def _check_bins(num_bins: int) -> None:
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")


def ece_columns(probs: torch.Tensor, labels: torch.Tensor, *, num_bins: int = DEFAULT_NUM_BINS
                ) -> torch.Tensor:
    """ECE of each column of ``probs`` [N, G] float against ``labels`` [N] bool -> [G] float64.

    Vectorized over G so the STS grid search scores every temperature in one pass.
    Raises ValueError for N == 0, shape mismatch, values outside [0, 1]; TypeError on dtypes.
    """
    _check_bins(num_bins)
    if probs.dim() != 2 or labels.dim() != 1:
        raise ValueError(f"expected probs [N, G] and labels [N], got {tuple(probs.shape)} "
                         f"and {tuple(labels.shape)}")
    _check_probs_labels(probs, labels)
    n, g = probs.shape
    if n == 0:
        raise ValueError("ECE needs at least one sample")
    p = probs.to(torch.float64)
    bins = (p * num_bins).long().clamp_(0, num_bins - 1)
    flat = (bins + num_bins * torch.arange(g, device=p.device)).reshape(-1)
    residual = (p - labels.to(torch.float64).unsqueeze(1)).reshape(-1)
    per_bin = torch.bincount(flat, weights=residual, minlength=g * num_bins).view(g, num_bins)
    return per_bin.abs().sum(dim=1) / n


def ece(probs: torch.Tensor, labels: torch.Tensor, *, num_bins: int = DEFAULT_NUM_BINS) -> float:
    """Expected calibration error of ``probs`` [N] in [0, 1] against ``labels`` [N] bool."""
    if probs.dim() != 1:
        raise ValueError(f"expected probs [N], got {tuple(probs.shape)}")
    return float(ece_columns(probs.unsqueeze(1), labels, num_bins=num_bins)[0])


def brier(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Brier score mean((p - y)^2) of ``probs`` [N] in [0, 1] against ``labels`` [N] bool."""
    if probs.dim() != 1 or labels.dim() != 1:
        raise ValueError(f"expected 1-D probs and labels, got {tuple(probs.shape)}, {tuple(labels.shape)}")
    _check_probs_labels(probs, labels)
    if probs.numel() == 0:
        raise ValueError("Brier score needs at least one sample")
    return float((probs.to(torch.float64) - labels.to(torch.float64)).square().mean())


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact area under the ROC curve of ``scores`` [N] (any real values) for ``labels`` [N] bool.

    Rank form (Mann-Whitney U): (sum of positive ranks - P(P+1)/2) / (P * Q) with tied scores
    given their mean rank, so a tied positive/negative pair counts 1/2. Only the order of the
    scores matters. Returns NaN when all labels are equal (AUROC is undefined).
    """
    if scores.dim() != 1 or labels.dim() != 1:
        raise ValueError(f"expected 1-D scores and labels, got {tuple(scores.shape)}, {tuple(labels.shape)}")
    _check_probs_labels(scores, labels, scores=True)
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores.to(torch.float64), sorted=True,
                                      return_inverse=True, return_counts=True)
    counts = counts.to(torch.float64)
    midrank = torch.cumsum(counts, 0) - (counts - 1) / 2  # ranks are 1-based
    rank_sum = float(midrank[inverse][labels].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


@dataclass
class PositionMetrics:
    """Per draft position metrics of the cumulative survival a_k against prefix survival.

    ece, auroc, brier: [gamma] float64 (NaN where undefined: no valid rows, or one class only).
    count:             [gamma] int64 valid rows per position.
    """

    ece: torch.Tensor
    auroc: torch.Tensor
    brier: torch.Tensor
    count: torch.Tensor


def _check_per_position(survival, survived, valid):
    if survival.dim() != 2:
        raise ValueError(f"expected survival [N, gamma], got {tuple(survival.shape)}")
    _check_probs_labels(survival, survived)
    if valid is None:
        return torch.ones_like(survived)
    if valid.dtype != torch.bool or valid.shape != survived.shape:
        raise ValueError(f"valid must be a bool tensor of shape {tuple(survived.shape)}, "
                         f"got {valid.dtype} {tuple(valid.shape)}")
    return valid


def per_position_metrics(survival: torch.Tensor, survived: torch.Tensor,
                         valid: torch.Tensor | None = None, *, num_bins: int = DEFAULT_NUM_BINS
                         ) -> PositionMetrics:
    """ECE / AUROC / Brier of ``survival`` [N, gamma] (a_k in [0, 1]) against ``survived``
    [N, gamma] bool, position k using only rows with ``valid[:, k]`` (default: all rows)."""
    valid = _check_per_position(survival, survived, valid)
    out = {name: torch.full((survival.shape[1],), float("nan"), dtype=torch.float64)
           for name in ("ece", "auroc", "brier")}
    for k in range(survival.shape[1]):
        p, y = survival[valid[:, k], k], survived[valid[:, k], k]
        if p.numel():
            out["ece"][k] = ece(p, y, num_bins=num_bins)
            out["auroc"][k] = auroc(p, y)
            out["brier"][k] = brier(p, y)
    return PositionMetrics(count=valid.sum(dim=0).cpu(), **out)


def calibration_bins(probs: torch.Tensor, labels: torch.Tensor, *, num_bins: int = DEFAULT_NUM_BINS
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reliability-curve points of ``probs`` [N] against ``labels`` [N] bool, bins as for ECE.

    Returns (count [B] int64, mean predicted [B] float64, empirical rate [B] float64); the means
    are NaN in empty bins.
    """
    _check_bins(num_bins)
    if probs.dim() != 1:
        raise ValueError(f"expected probs [N], got {tuple(probs.shape)}")
    _check_probs_labels(probs, labels)
    p = probs.to(torch.float64)
    bins = (p * num_bins).long().clamp_(0, num_bins - 1)
    count = torch.bincount(bins, minlength=num_bins)
    denom = count.to(torch.float64).masked_fill(count == 0, float("nan"))
    mean_p = torch.bincount(bins, weights=p, minlength=num_bins) / denom
    rate = torch.bincount(bins, weights=labels.to(torch.float64), minlength=num_bins) / denom
    return count, mean_p, rate


def reliability_diagram(path: str | Path, survival_before: torch.Tensor, survived: torch.Tensor, *,
                        survival_after: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                        num_bins: int = DEFAULT_NUM_BINS, pooled: bool = False, dpi: int = 100,
                        figsize: tuple[float, float] | None = None, title: str | None = None) -> Path:
    """Write a PNG reliability diagram like the paper's Figure 6 and return its path.

    One panel per draft position (or one panel pooling every valid (row, position) pair when
    ``pooled``): empirical prefix-survival rate against mean predicted survival per bin, for the
    raw ``survival_before`` and, if given, the STS-calibrated ``survival_after`` (both [N, gamma]
    a_k in [0, 1]), with the diagonal and a background histogram of the fraction of samples per
    bin. The image is figsize * dpi pixels (default figsize: 4 x 3.4 inches per panel, up to 4
    panels a row). Drawn on an Agg canvas without pyplot, so global matplotlib state is untouched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    valid = _check_per_position(survival_before, survived, valid)
    curves = {"raw": survival_before}
    if survival_after is not None:
        if survival_after.shape != survival_before.shape:
            raise ValueError(f"survival_after shape {tuple(survival_after.shape)} does not match "
                             f"survival_before shape {tuple(survival_before.shape)}")
        _check_probs_labels(survival_after, survived)
        curves["STS"] = survival_after
    gamma = survival_before.shape[1]
    if pooled:
        panels = [("all positions", {name: s[valid] for name, s in curves.items()}, survived[valid])]
    else:
        panels = [(f"position {k + 1}", {name: s[valid[:, k], k] for name, s in curves.items()},
                   survived[valid[:, k], k]) for k in range(gamma)]
    ncols = min(len(panels), 4)
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=figsize or (4.0 * ncols, 3.4 * nrows), dpi=dpi)
    FigureCanvasAgg(fig)
    edges = torch.linspace(0, 1, num_bins + 1).tolist()
    width = 1.0 / num_bins
    for i, (name, preds, labels) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        hist = ax.twinx()
        ax.set_zorder(hist.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.plot([0, 1], [0, 1], linestyle="--", color="gray", linewidth=1)
        for (label, p), color in zip(preds.items(), ("tab:red", "tab:blue")):
            if p.numel() == 0:
                continue
            count, mean_p, rate = calibration_bins(p, labels, num_bins=num_bins)
            keep = count > 0
            ax.plot(mean_p[keep].tolist(), rate[keep].tolist(), marker="o", markersize=3,
                    color=color, label=f"{label} (ECE {100 * ece(p, labels, num_bins=num_bins):.1f}%)")
            hist.bar(edges[:-1], (count / count.sum()).tolist(), width=width, align="edge",
                     color=color, alpha=0.15)
        ax.set(xlim=(0, 1), ylim=(0, 1.02), title=f"{name} (n={labels.numel()})",
               xlabel="predicted survival", ylabel="empirical survival")
        hist.set_ylabel("fraction of samples")
        if labels.numel():
            ax.legend(loc="upper left", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=dpi)
    return path
