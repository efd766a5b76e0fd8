"""dspark-serve: DSpark speculative decoding (drafter, STS calibration, hardware-aware
prefix scheduling, lossless verification), an embedded CPU engine and an OpenAI server."""

__version__ = "0.1.0"
