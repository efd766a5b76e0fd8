// Binding of the fused Markov sampler: shape/dtype/device checks, workspace, launch.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "markov_sample.cuh"
#include "ops.h"

namespace dspark {
namespace {

template <typename T>
void run(const at::Tensor& base_logits, const at::Tensor& hidden, const at::Tensor& w1, const at::Tensor& w2,
         const std::optional<at::Tensor>& conf_weight, const std::optional<at::Tensor>& conf_bias,
         const at::Tensor& anchor, const at::Tensor& temperature, const at::Tensor& top_k,
         const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniforms, at::Tensor& tokens,
         at::Tensor& probs, at::Tensor& conf_logits, int64_t launch_mode) {
  markov::Params<T> p{};
  p.base_logits = static_cast<const T*>(base_logits.data_ptr());
  p.hidden = static_cast<const T*>(hidden.data_ptr());
  p.w1 = static_cast<const T*>(w1.data_ptr());
  p.w2 = static_cast<const T*>(w2.data_ptr());
  p.conf_w = conf_weight ? static_cast<const T*>(conf_weight->data_ptr()) : nullptr;
  p.conf_b = conf_bias ? static_cast<const T*>(conf_bias->data_ptr()) : nullptr;
  p.anchor = anchor.data_ptr<int64_t>();
  p.temperature = temperature.data_ptr<float>();
  p.top_k = top_k.data_ptr<int64_t>();
  p.top_p = top_p.data_ptr<float>();
  p.min_p = min_p.data_ptr<float>();
  p.uniforms = uniforms.data_ptr<float>();
  p.tokens = tokens.data_ptr<int64_t>();
  p.probs = probs.data_ptr<float>();
  p.conf = conf_logits.data_ptr<float>();
  p.R = static_cast<int>(base_logits.size(0));
  p.G = static_cast<int>(base_logits.size(1));
  p.V = static_cast<int>(base_logits.size(2));
  p.rank = static_cast<int>(w1.size(1));
  p.d = static_cast<int>(hidden.size(2));
  const int rows = std::min(p.R, markov::max_rows_per_launch<T>());
  at::Tensor workspace = at::empty({static_cast<int64_t>(markov::workspace_bytes(rows, p.V))},
                                   base_logits.options().dtype(at::kByte));
  const cudaError_t err = markov::launch<T>(p, workspace.data_ptr(), static_cast<markov::LaunchMode>(launch_mode),
                                            c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err != cudaErrorInvalidConfiguration,
              "markov_sample: shared memory needed for rank ", p.rank, " and V ", p.V,
              " exceeds this device's per-block limit");
  TORCH_CHECK(err != cudaErrorCooperativeLaunchTooLarge,
              "markov_sample: launch_mode=1 (persistent) is not possible on this device; use 0 or 2");
  C10_CUDA_CHECK(err);
}

}  // namespace

void markov_sample(const at::Tensor& base_logits, const at::Tensor& hidden, const at::Tensor& w1,
                   const at::Tensor& w2, const std::optional<at::Tensor>& conf_weight,
                   const std::optional<at::Tensor>& conf_bias, const at::Tensor& anchor,
                   const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                   const at::Tensor& min_p, const at::Tensor& uniforms, at::Tensor& tokens,
                   at::Tensor& probs, at::Tensor& conf_logits, int64_t launch_mode) {
  TORCH_CHECK(base_logits.is_cuda() && base_logits.dim() == 3, "base_logits must be a CUDA [R, gamma, V] tensor");
  const at::Device device = base_logits.device();
  const at::ScalarType dtype = base_logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "base_logits must be float32, float16 or bfloat16, got ", dtype);
  const int64_t R = base_logits.size(0), G = base_logits.size(1), V = base_logits.size(2);
  TORCH_CHECK(w1.dim() == 2 && hidden.dim() == 3, "w1 must be [V, rank] and hidden [R, gamma, d]");
  const int64_t rank = w1.size(1), d = hidden.size(2);
  check_tensor(base_logits, "base_logits", device, dtype, {R, G, V});
  check_tensor(hidden, "hidden", device, dtype, {R, G, d});
  check_tensor(w1, "w1", device, dtype, {V, rank});
  check_tensor(w2, "w2", device, dtype, {V, rank});
  TORCH_CHECK(rank > 0 && rank % 16 == 0, "Markov rank must be a positive multiple of 16, got ", rank);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w1.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(w2.data_ptr()) % 16 == 0,
              "w1 and w2 must be 16-byte aligned");
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 30), "vocabulary size out of range: ", V);
  TORCH_CHECK(conf_weight.has_value() == conf_bias.has_value(), "conf_weight and conf_bias go together");
  if (conf_weight) {
    check_tensor(*conf_weight, "conf_weight", device, dtype, {d + rank});
    check_tensor(*conf_bias, "conf_bias", device, dtype, {1});
  }
  check_tensor(anchor, "anchor", device, at::kLong, {R});
  check_tensor(temperature, "temperature", device, at::kFloat, {R});
  check_tensor(top_k, "top_k", device, at::kLong, {R});
  check_tensor(top_p, "top_p", device, at::kFloat, {R});
  check_tensor(min_p, "min_p", device, at::kFloat, {R});
  check_tensor(uniforms, "uniforms", device, at::kFloat, {R, G});
  check_tensor(tokens, "tokens", device, at::kLong, {R, G});
  check_tensor(probs, "probs", device, at::kFloat, {R, G, V});
  check_tensor(conf_logits, "conf_logits", device, at::kFloat, {R, G});
  TORCH_CHECK(launch_mode >= 0 && launch_mode <= 2, "launch_mode must be 0 (auto), 1 (persistent) or 2 (per phase)");

  const c10::cuda::CUDAGuard guard(device);
  switch (dtype) {
    case at::kFloat:
      run<float>(base_logits, hidden, w1, w2, conf_weight, conf_bias, anchor, temperature, top_k, top_p, min_p,
                 uniforms, tokens, probs, conf_logits, launch_mode);
      break;
    case at::kHalf:
      run<__half>(base_logits, hidden, w1, w2, conf_weight, conf_bias, anchor, temperature, top_k, top_p, min_p,
                  uniforms, tokens, probs, conf_logits, launch_mode);
      break;
    default:
      run<__nv_bfloat16>(base_logits, hidden, w1, w2, conf_weight, conf_bias, anchor, temperature, top_k, top_p,
                         min_p, uniforms, tokens, probs, conf_logits, launch_mode);
  }
}

}  // namespace dspark
