"""SPS(B) profiling of the target forward per device SKU, written as the scheduler's cost table
(SGLang-compatible JSON) plus a PNG. ``python -m profiler --help`` / ``dspark-serve profile``.

``profile_cost_table(model, cache, ...)`` is the engine's few-second startup profile."""
from profiler.runner import profile_cost_table

__all__ = ["profile_cost_table"]
