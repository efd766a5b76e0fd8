"""Sequential Temperature Scaling (paper Section 3.2.1, "Post-hoc Calibration").

The confidence head (Eq 7) emits a logit z_k per draft position; its sigmoid c_k estimates the
conditional survival of draft token k given that tokens 1..k-1 were accepted, and the scheduler
uses the prefix survival a_k = prod_{i<=k} c_i. STS rescales each position's logit by its own
temperature, c_k = sigmoid(z_k / T_k), fitting T_1, ..., T_gamma left to right on held-out
rounds: T_k minimizes the ECE of a_k against the observed prefix survival with T_1..T_{k-1}
fixed. Dividing a logit by T > 0 keeps the order of c_k, so the head's ranking is untouched.

Labels. ``survived[:, k-1]`` must be the real outcome of chain rejection sampling at the serving
sampling temperature (``dspark_serve.verify.rejection``): draft tokens 1..k all accepted. Under
rejection sampling draft token x ~ p_d is accepted with probability min(1, p_t(x) / p_d(x)), whose
mean is 1 - TV(p_d, p_t) (Eq 8), the quantity the head is trained on. SGLang 0.5.23 collects its
STS labels by argmax match instead (``dspark_observability._maybe_record_sts_collect``: draft token
== target argmax), which is the same event only when sampling is greedy. At temperature > 0 the
two differ: with p_t = p_d = (0.5, 0.5) rejection sampling always accepts, argmax match accepts
half the time. Temperatures fit on argmax labels then make the scheduler underestimate survival
and verify too few tokens. Calibrate at the temperature you serve at (note it in ``dataset``).

Censoring. A round verifies only l_r <= gamma tokens, so prefix survival at k > l_r is unknown.
Position k is fit on rows with ``valid[:, k-1]`` = (l_r >= k) only (``prefix_survival_labels``).
Do not keep rows with l_r < k whose label is "known" to be 0 because a token before l_r was
rejected: which of those rows are kept would depend on the outcome (rounds that survived all l_r
tokens would be dropped, rejected ones kept), biasing the labels toward 0. Selecting on l_r alone
is harmless because the scheduler picks l_r from confidences, never from verification outcomes.
Calibration rounds verified at full gamma (static scheduler) make every row valid.
"""
from __future__ import annotations

import math

import torch

from dspark_serve.calibration.io import StsCalibration
from dspark_serve.calibration.metrics import DEFAULT_NUM_BINS, ece_columns, per_position_metrics


def default_temperature_grid() -> torch.Tensor:
    """41 temperatures log-spaced over [0.1, 10] (float64), the grid SGLang's fitter uses."""
    return torch.logspace(math.log10(0.1), math.log10(10.0), steps=41, dtype=torch.float64)


def calibrated_confidence(conf_logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Calibrated conditional survival c_k = sigmoid(z_k / T_k) (paper Section 3.2.1).

    conf_logits: [N, gamma] float raw confidence-head logits.
    temperatures: [gamma] float, all finite and > 0 (ones = no calibration).
    Returns [N, gamma] float32 (float64 if ``conf_logits`` is float64).
    Raises ValueError on shape mismatch or a temperature <= 0 / non-finite, TypeError on
    non-float input. The value check reads ``temperatures`` on the host (one tiny sync on GPU).
    """
    if not conf_logits.is_floating_point() or not temperatures.is_floating_point():
        raise TypeError(f"conf_logits and temperatures must be float tensors, got "
                        f"{conf_logits.dtype} and {temperatures.dtype}")
    if conf_logits.dim() != 2 or temperatures.shape != conf_logits.shape[1:]:
        raise ValueError(f"expected conf_logits [N, gamma] and temperatures [gamma], got "
                         f"{tuple(conf_logits.shape)} and {tuple(temperatures.shape)}")
    if not bool(((temperatures > 0) & torch.isfinite(temperatures)).all()):
        raise ValueError(f"STS temperatures must be finite and > 0, got {temperatures.tolist()}")
    dtype = torch.float64 if conf_logits.dtype == torch.float64 else torch.float32
    return torch.sigmoid(conf_logits.to(dtype) / temperatures.to(device=conf_logits.device, dtype=dtype))


def prefix_survival_labels(num_accepted: torch.Tensor, lengths: torch.Tensor, gamma: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """STS labels from verification outcomes (``VerifyResult.num_accepted``, scheduled lengths).

    num_accepted: [N] int64 accepted draft tokens n_r (0..l_r); lengths: [N] int64 l_r (0..gamma).
    Returns (survived, valid), both [N, gamma] bool: survived[r, k-1] = n_r >= k,
    valid[r, k-1] = l_r >= k (see "Censoring" above). ValueError on shapes or ranges.
    """
    if num_accepted.shape != lengths.shape or num_accepted.dim() != 1:
        raise ValueError(f"expected num_accepted [N] and lengths [N], got "
                         f"{tuple(num_accepted.shape)} and {tuple(lengths.shape)}")
    if ((lengths < 0) | (lengths > gamma) | (num_accepted < 0) | (num_accepted > lengths)).any():
        raise ValueError(f"need 0 <= num_accepted <= lengths <= gamma={gamma}")
    k = torch.arange(1, gamma + 1, device=lengths.device)
    return num_accepted.unsqueeze(1) >= k, lengths.unsqueeze(1) >= k


def fit_sts(conf_logits: torch.Tensor, survived: torch.Tensor, *, valid: torch.Tensor | None = None,
            grid: torch.Tensor | None = None, num_bins: int = DEFAULT_NUM_BINS) -> torch.Tensor:
    """Fit STS temperatures by per-position grid search (paper Section 3.2.1).

    conf_logits: [N, gamma] float raw confidence-head logits of held-out drafting rounds.
    survived: [N, gamma] bool, draft tokens 1..k all accepted by rejection sampling.
    valid: [N, gamma] bool, position k's label was observed (l_r >= k); default all True.
    grid: [G] candidate temperatures, finite and > 0 (default ``default_temperature_grid()``).
    Returns [gamma] float32 temperatures. Every grid value is scored at once per position; ties
    go to the earliest grid entry. ValueError on shape mismatch, a bad grid, labels that are not
    prefix-closed on valid entries, or a position without valid rows.
    """
    if conf_logits.dim() != 2 or survived.shape != conf_logits.shape:
        raise ValueError(f"expected conf_logits and survived [N, gamma], got "
                         f"{tuple(conf_logits.shape)} and {tuple(survived.shape)}")
    if survived.dtype != torch.bool or not conf_logits.is_floating_point():
        raise TypeError(f"expected float conf_logits and bool survived, got {conf_logits.dtype}, {survived.dtype}")
    valid = torch.ones_like(survived) if valid is None else valid
    if valid.dtype != torch.bool or valid.shape != survived.shape:
        raise ValueError(f"valid must be bool of shape {tuple(survived.shape)}, got {valid.dtype} {tuple(valid.shape)}")
    grid = default_temperature_grid() if grid is None else grid.to(torch.float64)
    if grid.dim() != 1 or grid.numel() == 0 or not bool(((grid > 0) & torch.isfinite(grid)).all()):
        raise ValueError("grid must be a non-empty 1-D tensor of finite temperatures > 0")
    if not torch.isfinite(conf_logits).all():
        raise ValueError("conf_logits contain NaN or inf")
    both = valid[:, 1:] & valid[:, :-1]
    if (survived[:, 1:] & ~survived[:, :-1] & both).any():
        raise ValueError("survived is not prefix-closed: a row survives position k+1 but not k "
                         "(labels must be prefix survival, not per-token matches)")
    z = conf_logits.to(torch.float64)
    grid = grid.to(z.device)
    prefix = torch.ones(z.shape[0], dtype=torch.float64, device=z.device)
    temperatures = []
    for k in range(z.shape[1]):
        rows = valid[:, k]
        if not bool(rows.any()):
            raise ValueError(f"no valid rows at position {k + 1}; collect rounds verified to gamma")
        candidates = prefix[rows, None] * torch.sigmoid(z[rows, k, None] / grid)  # [N_k, G]
        best = int(torch.argmin(ece_columns(candidates, survived[rows, k], num_bins=num_bins)))
        temperatures.append(float(grid[best]))
        prefix = prefix * torch.sigmoid(z[:, k] / grid[best])
    return torch.tensor(temperatures, dtype=torch.float32)


def fit_calibration(conf_logits: torch.Tensor, survived: torch.Tensor, *,
                    valid: torch.Tensor | None = None, grid: torch.Tensor | None = None,
                    num_bins: int = DEFAULT_NUM_BINS, dataset: str = "") -> StsCalibration:
    """``fit_sts`` plus the per-position ECE of a_k before (all T = 1) and after, as the
    SGLang-compatible ``StsCalibration`` record (arguments as for ``fit_sts``)."""
    temperatures = fit_sts(conf_logits, survived, valid=valid, grid=grid, num_bins=num_bins)
    z = conf_logits.to(torch.float64)
    ece_of = [per_position_metrics(torch.cumprod(calibrated_confidence(z, t.to(z.device, torch.float64)), 1),
                                   survived, valid, num_bins=num_bins).ece.tolist()
              for t in (torch.ones_like(temperatures), temperatures)]
    return StsCalibration(temperatures=temperatures.tolist(), dataset=dataset,
                          num_samples=int(conf_logits.shape[0]), ece_before=ece_of[0], ece_after=ece_of[1])
