"""The target side of speculative decoding: per-step verify layout (``metadata``), target
distributions with penalties, grammar masks and warping, seeded replay, and lossless chain
rejection sampling (``target_sampler.TargetSampler`` owns the whole of it)."""
from dspark_serve.verify.rejection import rejection_sample

__all__ = ["rejection_sample"]
