// Shared definitions of the fused Markov sampler (markov_sample.cuh): constants, kernel
// parameters and shared-memory layouts.
#pragma once

#include <climits>
#include <cstddef>
#include <type_traits>

#include "common.cuh"

namespace dspark {
namespace markov {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kTileV = 64;               // vocabulary columns per tile
constexpr int kBiasLd = kTileV + 4;      // float row stride of the bias tile
constexpr int kChunk = 1024;             // tokens per chunk of the inverse-CDF search
constexpr int kBins = 256;               // radix digits per pass
constexpr float kGreedyTemperature = 1e-5f;  // = sampling.warping.GREEDY_TEMPERATURE
constexpr int kMaxRows16 = 128;          // requests per launch, 16-bit weights
constexpr int kMaxRows32 = 64;           // requests per launch, fp32 weights

template <typename T>
struct Params {
  const T* base_logits;     // [R, G, V]
  const T* hidden;          // [R, G, d]          (unused without a confidence head)
  const T* w1;              // [V, rank]
  const T* w2;              // [V, rank]
  const T* conf_w;          // [d + rank] or nullptr
  const T* conf_b;          // [1] or nullptr
  const int64_t* anchor;    // [R]
  const float* temperature; // [R]
  const int64_t* top_k;     // [R]
  const float* top_p;       // [R]
  const float* min_p;       // [R]
  const float* uniforms;    // [R, G]
  int64_t* tokens;          // [R, G]
  float* probs;             // [R, G, V]; holds z = logits / T until the step is finalised
  float* conf;              // [R, G]
  // workspace (per launch)
  float* tile_max;          // [R, num_tiles]
  int* tile_arg;            // [R, num_tiles]
  int64_t* prev;            // [R] x_{k-1}
  float* fin_max;           // [R] max_v z
  float* fin_cut;           // [R] token kept iff exp(z - max) >= cut
  float* fin_sum;           // [R] kept mass
  int* fin_arg;             // [R] argmax (greedy rows)
  int R, G, V, rank, d, num_tiles, rows_pad;
};

template <typename T>
constexpr bool kScalarPath = std::is_same<T, float>::value;

// Shared-memory row stride (elements) of the embedding block and the W2 tile: +1 float
// keeps the scalar GEMM free of bank conflicts, +8 halves keeps WMMA pointers 32-byte aligned.
template <typename T>
__host__ __device__ constexpr int smem_ld(int rank) { return kScalarPath<T> ? rank + 1 : rank + 8; }

struct Select {
  unsigned int prefix, mask;
  unsigned long long above, threshold;
  int active;
};

struct SampleSmem {
  unsigned long long hist[2][kBins];
  Select sel[2];
  float red_f[kWarps];
  int red_i[kWarps];
  int64_t token;
  float kept;
};

template <typename T>
inline size_t tile_smem_bytes(int rows_pad, int rank) {
  return static_cast<size_t>(rows_pad + kTileV) * smem_ld<T>(rank) * sizeof(T) +
         static_cast<size_t>(rows_pad) * kBiasLd * sizeof(float);
}

inline size_t sample_smem_bytes(int V) {
  return sizeof(SampleSmem) + static_cast<size_t>(ceil_div(V, kChunk)) * sizeof(float);
}

__device__ __forceinline__ int64_t ld_cg(const int64_t* p) {
  return static_cast<int64_t>(__ldcg(reinterpret_cast<const long long*>(p)));
}

}  // namespace markov
}  // namespace dspark
