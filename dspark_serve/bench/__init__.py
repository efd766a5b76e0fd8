"""Micro-benchmarks behind ``dspark-serve bench`` (one module per benchmark, see ``cli``)."""
