"""Confidence calibration: Sequential Temperature Scaling (paper Section 3.2.1), its metrics
(ECE / AUROC / Brier, reliability diagram) and the SGLang-compatible calibration file."""
from dspark_serve.calibration.io import StsCalibration, load_sts_calibration, save_sts_calibration
from dspark_serve.calibration.sts import (calibrated_confidence, default_temperature_grid,
                                          fit_calibration, fit_sts, prefix_survival_labels)

__all__ = ["StsCalibration", "load_sts_calibration", "save_sts_calibration", "calibrated_confidence",
           "default_temperature_grid", "fit_calibration", "fit_sts", "prefix_survival_labels"]
