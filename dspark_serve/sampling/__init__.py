"""Sampling primitives shared by the drafter and the verifier: logit warping into the
distribution actually sampled from, inverse-CDF sampling from explicit uniforms, and the row
argmax of greedy rows (``argmax``)."""
from dspark_serve.sampling.sampler import draw_uniforms, sample_from_probs
from dspark_serve.sampling.warping import warp_probs

__all__ = ["draw_uniforms", "sample_from_probs", "warp_probs"]
