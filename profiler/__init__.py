"""``dspark-serve profile``: SPS(B) of the target forward per device SKU, written as the
scheduler's cost table (SGLang-compatible JSON) plus a PNG. ``python -m dspark_serve.profiler
--help``. Installed as ``dspark_serve.profiler``; the measurement and the engine's startup
profile live in ``dspark_serve.profiling``."""
