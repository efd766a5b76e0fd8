// Tiles phase of the fused Markov sampler: per 64-token vocabulary tile, the Eq 5 bias
// for all requests (one read of the W2 tile), scaled logits, tile max/argmax, and the
// previous step's final probabilities.
#pragma once

#include <mma.h>

#include "markov_common.cuh"

namespace dspark {
namespace markov {

// 16-byte vectors: rank is a multiple of 16, so rows of W1/W2 are whole vectors. The fp32
// path's odd shared-memory stride needs element stores.
template <typename T>
__device__ __forceinline__ void store_vec(T* dst, uint4 v) {
  if constexpr (kScalarPath<T>) {
    dst[0] = __uint_as_float(v.x);
    dst[1] = __uint_as_float(v.y);
    dst[2] = __uint_as_float(v.z);
    dst[3] = __uint_as_float(v.w);
  } else {
    *reinterpret_cast<uint4*>(dst) = v;
  }
}

// Es[r] = W1[x_{step-1} of request r]; rows >= R are zero so the GEMM reads zeros.
template <typename T>
__device__ void load_embeddings(const Params<T>& p, int step, T* Es) {
  constexpr int kVec = 16 / sizeof(T);
  const int ld = smem_ld<T>(p.rank), vecs = p.rank / kVec;
#pragma unroll 4
  for (int idx = threadIdx.x; idx < p.rows_pad * vecs; idx += kThreads) {
    const int r = idx / vecs, j = (idx % vecs) * kVec;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < p.R) {
      int64_t tok = step == 0 ? p.anchor[r] : ld_cg(p.prev + r);
      tok = tok < 0 ? 0 : (tok >= p.V ? p.V - 1 : tok);  // never read outside W1
      v = __ldg(reinterpret_cast<const uint4*>(p.w1 + tok * p.rank + j));
    }
    store_vec(Es + r * ld + j, v);
  }
}

template <typename T>
__device__ void load_w2_tile(const Params<T>& p, int v0, T* W2s) {
  constexpr int kVec = 16 / sizeof(T);
  const int ld = smem_ld<T>(p.rank), vecs = p.rank / kVec;
#pragma unroll 4
  for (int idx = threadIdx.x; idx < kTileV * vecs; idx += kThreads) {
    const int c = idx / vecs, j = (idx % vecs) * kVec;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (v0 + c < p.V) v = __ldg(reinterpret_cast<const uint4*>(p.w2 + static_cast<size_t>(v0 + c) * p.rank + j));
    store_vec(W2s + c * ld + j, v);
  }
}

// Bs[r][c] = sum_j E[r][j] * W2[v0 + c][j] for r < rows_pad, c < kTileV.
template <typename T>
__device__ void tile_bias(const Params<T>& p, const T* Es, const T* W2s, float* Bs) {
  const int ld = smem_ld<T>(p.rank);
  if constexpr (kScalarPath<T>) {
    constexpr int kGroups = kThreads / kTileV, kPerThread = kMaxRows32 / kGroups;
    const int c = threadIdx.x % kTileV, g = threadIdx.x / kTileV;
    float acc[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) acc[i] = 0.f;
    for (int j = 0; j < p.rank; ++j) {
      const float w = W2s[c * ld + j];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int r = g + kGroups * i;
        if (r < p.rows_pad) acc[i] = fmaf(Es[r * ld + j], w, acc[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int r = g + kGroups * i;
      if (r < p.rows_pad) Bs[r * kBiasLd + c] = acc[i];
    }
  } else {
    using namespace nvcuda;
    const int warp = threadIdx.x / kWarpSize;
    const int mblocks = p.rows_pad / 16, nblocks = kTileV / 16;
    for (int f = warp; f < mblocks * nblocks; f += kWarps) {
      const int mb = f / nblocks, nb = f % nblocks;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
      for (int kk = 0; kk < p.rank; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
        wmma::load_matrix_sync(a, Es + mb * 16 * ld + kk, ld);
        wmma::load_matrix_sync(b, W2s + nb * 16 * ld + kk, ld);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(Bs + mb * 16 * kBiasLd + nb * 16, acc, kBiasLd, wmma::mem_row_major);
    }
  }
}

// z = (U + bias) / T (greedy rows: unscaled) into probs; per-tile max and first argmax.
template <typename T>
__device__ void tile_logits(const Params<T>& p, int step, int tile, const float* Bs) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int v0 = tile * kTileV;
  for (int r = warp; r < p.R; r += kWarps) {
    const float t = p.temperature[r];
    const bool greedy = t < kGreedyTemperature;
    const size_t row = (static_cast<size_t>(r) * p.G + step) * p.V;
    float best = -INFINITY;
    int best_i = v0 + lane < p.V ? v0 + lane : INT_MAX;
#pragma unroll
    for (int h = 0; h < kTileV / kWarpSize; ++h) {
      const int c = lane + kWarpSize * h, v = v0 + c;
      if (v < p.V) {
        const float logit = to_float(p.base_logits[row + v]) + Bs[r * kBiasLd + c];
        const float z = greedy ? logit : logit / t;
        p.probs[row + v] = z;
        if (z > best) {
          best = z;
          best_i = v;
        }
      }
    }
    warp_argmax(best, best_i);
    if (lane == 0) {
      p.tile_max[static_cast<size_t>(r) * p.num_tiles + tile] = best;
      p.tile_arg[static_cast<size_t>(r) * p.num_tiles + tile] = best_i;
    }
  }
}

// Turns the z of a finished step into the warped probabilities.
template <typename T>
__device__ void tile_finalize(const Params<T>& p, int step, int tile) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int v0 = tile * kTileV;
  for (int r = warp; r < p.R; r += kWarps) {
    const bool greedy = p.temperature[r] < kGreedyTemperature;
    const float m = __ldcg(p.fin_max + r), cut = __ldcg(p.fin_cut + r), kept = __ldcg(p.fin_sum + r);
    const int arg = __ldcg(p.fin_arg + r);
    const size_t row = (static_cast<size_t>(r) * p.G + step) * p.V;
#pragma unroll
    for (int h = 0; h < kTileV / kWarpSize; ++h) {
      const int v = v0 + lane + kWarpSize * h;
      if (v >= p.V) continue;
      float out;
      if (greedy) {
        out = v == arg ? 1.f : 0.f;
      } else {
        const float e = expf(__ldcg(p.probs + row + v) - m);
        out = e >= cut ? e / kept : 0.f;
      }
      p.probs[row + v] = out;
    }
  }
}

// Step `step` < G: logits of that step; step > 0: finalise step - 1. Tiles are strided
// over `nblocks` blocks; a W2 tile is loaded once and used for every request.
template <typename T>
__device__ void tiles_phase(const Params<T>& p, int step, unsigned char* smem, int block, int nblocks) {
  const int ld = smem_ld<T>(p.rank);
  T* Es = reinterpret_cast<T*>(smem);
  T* W2s = Es + static_cast<size_t>(p.rows_pad) * ld;
  float* Bs = reinterpret_cast<float*>(W2s + static_cast<size_t>(kTileV) * ld);
  const bool compute = step < p.G;
  if (compute) load_embeddings(p, step, Es);
  for (int tile = block; tile < p.num_tiles; tile += nblocks) {
    if (step > 0) tile_finalize(p, step - 1, tile);
    if (!compute) continue;
    load_w2_tile(p, tile * kTileV, W2s);
    __syncthreads();
    tile_bias(p, Es, W2s, Bs);
    __syncthreads();
    tile_logits(p, step, tile, Bs);
    __syncthreads();
  }
}

}  // namespace markov
}  // namespace dspark
