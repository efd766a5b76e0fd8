"""The project's own kernels: fused Markov block sampling and paged variable-length verify
attention, each a CUDA op (``csrc/``, ``torch.ops.dspark.*``) with a PyTorch reference that
the CPU engine uses; the dispatchers here pick the CUDA op for GPU tensors when the extension
is built. Also the per-request Philox uniform streams both paths share, and the page
bookkeeping of paged caches (``page_table``), and the CPU int4 fast path's kernel
(``quantized_linear``: AVX512-VNNI or AVX2 quantized projections and a fused decoder layer, compiled
on first use)."""
from dspark_serve.ops.extension import cuda_ops_available
from dspark_serve.ops.markov import markov_sample, markov_sample_reference
from dspark_serve.ops.paged_attention import varlen_attention, varlen_attention_reference
from dspark_serve.ops.philox import philox_uniforms

__all__ = ["cuda_ops_available", "markov_sample", "markov_sample_reference", "philox_uniforms",
           "varlen_attention", "varlen_attention_reference"]
