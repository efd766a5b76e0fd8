// Registers the dspark ops with the torch dispatcher. Outputs are caller-allocated
// (mutable arguments) and no op synchronises with the host, so all of them can be
// captured in CUDA graphs.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(dspark, m) {
  m.def("philox_uniforms(Tensor seed, Tensor offset, Tensor(a!) out) -> ()");
  m.def(
      "markov_sample(Tensor base_logits, Tensor hidden, Tensor w1, Tensor w2, Tensor? conf_weight, "
      "Tensor? conf_bias, Tensor anchor, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
      "Tensor uniforms, Tensor(a!) tokens, Tensor(b!) probs, Tensor(c!) conf_logits, int launch_mode) -> ()");
  m.def(
      "varlen_attention(Tensor q, Tensor marker, Tensor k_cache, Tensor v_cache, Tensor page_table, "
      "Tensor(a!) out, float scale, int num_splits) -> ()");
}

TORCH_LIBRARY_IMPL(dspark, CUDA, m) {
  m.impl("philox_uniforms", &dspark::philox_uniforms);
  m.impl("markov_sample", &dspark::markov_sample);
  m.impl("varlen_attention", &dspark::varlen_attention);
}
