"""Offline evaluation of a drafter against its target (paper Section 4): chained drafting
rounds at a fixed block size with full verification (``rounds``), accepted length, position-wise
acceptance, threshold sweeps and calibration metrics (``metrics``), and the ``calibrate`` /
``eval`` commands."""
