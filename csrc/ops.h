// Host entry points of the dspark CUDA ops (registered in registration.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace dspark {

void philox_uniforms(const at::Tensor& seed, const at::Tensor& offset, at::Tensor& out);

void markov_sample(const at::Tensor& base_logits, const at::Tensor& hidden, const at::Tensor& w1,
                   const at::Tensor& w2, const std::optional<at::Tensor>& conf_weight,
                   const std::optional<at::Tensor>& conf_bias, const at::Tensor& anchor,
                   const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                   const at::Tensor& min_p, const at::Tensor& uniforms, at::Tensor& tokens,
                   at::Tensor& probs, at::Tensor& conf_logits, int64_t launch_mode);

void varlen_attention(const at::Tensor& q, const at::Tensor& marker, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& page_table, at::Tensor& out,
                      double scale, int64_t num_splits);

// TORCH_CHECKs that `t` is a CUDA tensor on `device` with `dtype` and exactly `shape`.
inline void check_tensor(const at::Tensor& t, const char* name, const at::Device& device,
                         at::ScalarType dtype, const std::vector<int64_t>& shape) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes().vec() == shape, name, " must have shape ", at::IntArrayRef(shape), ", got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace dspark
