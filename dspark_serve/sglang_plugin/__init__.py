"""SGLang plugin: DSpark-serve's drafter checks, asynchronous scheduler (paper Section 5.2),
calibration and cost-table files inside stock ``sglang==0.5.23`` as the speculative algorithm
``DSPARK_SERVE`` (``pip install 'dspark-serve[sglang]'``; see README.md here).

Nothing in this package imports sglang at import time: ``register`` (the
``sglang.srt.plugins`` entry point), ``worker``, ``spec_algo`` and ``model`` import it lazily,
so ``import dspark_serve`` works without SGLang. ``scheduling``, ``results``, ``verify_fixes``,
``algorithm_name`` and ``launch`` are plain PyTorch / Python and testable on a CPU.
"""

ALGORITHM_NAME = "DSPARK_SERVE"
# Architecture our drafter class is registered under in SGLang's ModelRegistry. A distinct
# name (the draft worker renames the loaded config's architecture to it), so SGLang's own
# ``Qwen3DSparkModel`` stays untouched for its DSPARK baseline in the same installation.
DRAFTER_ARCHITECTURE = "DSparkServeDrafter"
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "dspark_serve"
