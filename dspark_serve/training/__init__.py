"""Drafter training pipeline (paper Section 3.3): regenerate responses with the target
(``gen_data``), sample anchors and lay out blocks (``anchors``), run the frozen target for hidden
taps and target distributions (``target_features``), the drafter's teacher-forced forward
(``forward``), the losses of Eq 8-12 (``losses``) and the training loop (``trainer``)."""
