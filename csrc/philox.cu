// Binding of the Philox uniform streams (definition in philox.cuh).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops.h"
#include "philox.cuh"

namespace dspark {

void philox_uniforms(const at::Tensor& seed, const at::Tensor& offset, at::Tensor& out) {
  TORCH_CHECK(out.is_cuda() && out.dim() == 2, "out must be a CUDA [R, n] float32 tensor");
  const at::Device device = out.device();
  const int64_t rows = out.size(0), n = out.size(1);
  check_tensor(out, "out", device, at::kFloat, {rows, n});
  check_tensor(seed, "seed", device, at::kLong, {rows});
  check_tensor(offset, "offset", device, at::kLong, {rows});
  TORCH_CHECK(rows * n < (int64_t(1) << 31), "at most 2^31 uniforms per call");
  const c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(launch_philox_uniforms(seed.data_ptr<int64_t>(), offset.data_ptr<int64_t>(),
                                        out.data_ptr<float>(), static_cast<int>(rows), static_cast<int>(n),
                                        c10::cuda::getCurrentCUDAStream()));
}

}  // namespace dspark
