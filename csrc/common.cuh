// Small device helpers shared by the dspark kernels: element conversion and
// deterministic warp reductions. No torch headers here: kernels and their host
// launchers build without ATen so that CMake and setup.py compile the same code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

namespace dspark {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Butterfly reductions: every lane ends with the same value, and the order of the
// additions is fixed, so results are bitwise reproducible run to run.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

// Maximum with the smallest index among equal maxima (torch.argmax's first-maximum rule).
__device__ __forceinline__ void warp_argmax(float& value, int& index) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(kFullMask, value, o);
    const int i = __shfl_xor_sync(kFullMask, index, o);
    if (v > value || (v == value && i < index)) {
      value = v;
      index = i;
    }
  }
}

// Inclusive prefix sum across the warp in lane order.
__device__ __forceinline__ float warp_inclusive_scan(float x) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int o = 1; o < kWarpSize; o <<= 1) {
    const float y = __shfl_up_sync(kFullMask, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

__device__ __forceinline__ unsigned long long warp_inclusive_scan_u64(unsigned long long x) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int o = 1; o < kWarpSize; o <<= 1) {
    const unsigned long long y = __shfl_up_sync(kFullMask, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// Raises `kernel`'s dynamic shared memory limit on the current device to at least `bytes`.
// Remembered per (kernel, device), so that the calls made while a CUDA graph is being
// captured (after a warm-up call) do not repeat the attribute call.
inline cudaError_t ensure_dynamic_smem(const void* kernel, size_t bytes) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> configured;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const std::lock_guard<std::mutex> lock(mutex);
  size_t& done = configured[{kernel, device}];
  if (done >= bytes) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err == cudaSuccess) done = bytes;
  return err;
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int round_up(int a, int b) { return ceil_div(a, b) * b; }

}  // namespace dspark
