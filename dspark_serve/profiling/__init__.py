"""SPS(B) profiling of the target forward (paper Section 3.2.2): the measurement itself
(``sps``) and the few-second startup profile the engine turns into its cost table
(``runner.profile_cost_table``). The ``dspark-serve profile`` tool (``dspark_serve.profiler``,
the top-level ``profiler/`` folder) adds device metadata, reports and plots on top."""
