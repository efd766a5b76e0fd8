// Philox4x32-10 counter-based random numbers (Salmon et al., SC 2011) and the
// per-request uniform streams used by the sampling kernels.
//
// Definition (mirrored bit for bit by dspark_serve/ops/philox.py):
//   u[r, i] = (word_{i mod 4}(philox(counter, key)) >> 8) * 2^-24, in [0, 1),
//   counter = (lo32(c), hi32(c), 0, 0) with c = offset[r] + i / 4,
//   key     = (lo32(seed[r]), hi32(seed[r])).
// A request that consumes n uniforms per step advances its offset by ceil(n / 4).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dspark {

struct Philox4 {
  uint32_t x, y, z, w;
};

__host__ __device__ __forceinline__ Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kBump0 = 0x9E3779B9u, kBump1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c.x;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c.z;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += kBump0;
    k1 += kBump1;
  }
  return c;
}

__device__ __forceinline__ float philox_uniform(int64_t seed, int64_t offset, int i) {
  const uint64_t c = static_cast<uint64_t>(offset) + static_cast<uint64_t>(i / 4);
  const uint64_t s = static_cast<uint64_t>(seed);
  const Philox4 out = philox4x32_10(
      Philox4{static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32), 0u, 0u},
      static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  const int w = i % 4;
  const uint32_t word = w == 0 ? out.x : (w == 1 ? out.y : (w == 2 ? out.z : out.w));
  return static_cast<float>(word >> 8) * (1.0f / 16777216.0f);
}

__global__ void philox_uniforms_kernel(const int64_t* __restrict__ seed,
                                       const int64_t* __restrict__ offset, float* __restrict__ out,
                                       int rows, int n) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(rows) * n) return;
  const int r = static_cast<int>(idx / n), i = static_cast<int>(idx % n);
  out[idx] = philox_uniform(seed[r], offset[r], i);
}

// Fills out[rows, n] (row-major float32). Returns the launch error, if any.
inline cudaError_t launch_philox_uniforms(const int64_t* seed, const int64_t* offset, float* out,
                                          int rows, int n, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(rows) * n;
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>((total + kThreads - 1) / kThreads);
  philox_uniforms_kernel<<<blocks, kThreads, 0, stream>>>(seed, offset, out, rows, n);
  return cudaGetLastError();
}

}  // namespace dspark
