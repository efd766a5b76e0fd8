// Fused Markov block sampling (paper Eq 4, 5, 7): all gamma draft positions of R requests
// in one persistent cooperative launch (or 2 * gamma + 1 plain launches as a fallback).
//
// Step k (x_0 = anchor):
//   logits_k = U[:, k] + W1[x_{k-1}] W2^T                    (Eq 5, W2 stored [V, rank])
//   p_k      = warp(logits_k; temperature, top-k, top-p, min-p)
//   x_k      = first v with cumsum(p_k)[v] > u_k * sum(p_k)  (inverse CDF, u from the caller)
//   conf_k   = w . [h_k ; W1[x_{k-1}]] + b                    (Eq 7, raw logit)
// The warping matches dspark_serve.sampling.warping.warp_probs: every filter is a cutoff on
// the post-temperature probabilities, tokens tied with the cutoff are kept, temperature
// < 1e-5 is greedy (one-hot at the first maximum).
//
// Phases of one step, separated by grid-wide barriers:
//   tiles:   each block takes 64-column vocabulary tiles; a W2 tile is read once for all
//            requests (tensor-core GEMM for fp16/bf16), scaled logits z = logits / T are
//            written into the probs buffer, and per-tile max/argmax go to the workspace.
//            The same pass turns the previous step's z into final probabilities.
//   rows:    one block per request: row max, top-k / top-p cutoffs by a 4-pass radix
//            select over e = exp(z - max) (top-p masses in 2^-32 fixed point, so the
//            result does not depend on atomic order), then the inverse-CDF draw over
//            1024-token chunks, and the confidence logit.
#pragma once

#include <cooperative_groups.h>
#include <mma.h>

#include <algorithm>
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

// ---------------------------------------------------------------- tiles phase

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

// ---------------------------------------------------------------- rows phase

// Sum over the block in a fixed order; every thread gets the total.
__device__ __forceinline__ float block_sum(float x, SampleSmem* s) {
  x = warp_sum(x);
  if (threadIdx.x % kWarpSize == 0) s->red_f[threadIdx.x / kWarpSize] = x;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += s->red_f[w];
  __syncthreads();
  return total;
}

__device__ __forceinline__ void block_argmax(float& value, int& index, SampleSmem* s) {
  warp_argmax(value, index);
  if (threadIdx.x % kWarpSize == 0) {
    s->red_f[threadIdx.x / kWarpSize] = value;
    s->red_i[threadIdx.x / kWarpSize] = index;
  }
  __syncthreads();
  value = s->red_f[0];
  index = s->red_i[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    if (s->red_f[w] > value || (s->red_f[w] == value && s->red_i[w] < index)) {
      value = s->red_f[w];
      index = s->red_i[w];
    }
  }
  __syncthreads();
}

// Calls f(e) for e = exp(z[v] - m), v < V, split over the block's threads.
template <typename F>
__device__ __forceinline__ void for_each_e(const float* z, int V, float m, F&& f) {
  if ((V & 3) == 0 && (reinterpret_cast<uintptr_t>(z) & 15) == 0) {
    const float4* z4 = reinterpret_cast<const float4*>(z);
    const int n4 = V / 4;
    for (int i = threadIdx.x; i < n4; i += 2 * kThreads) {
      const float4 a = __ldcg(z4 + i);
      const bool has_b = i + kThreads < n4;
      const float4 b = has_b ? __ldcg(z4 + i + kThreads) : a;
      f(expf(a.x - m)); f(expf(a.y - m)); f(expf(a.z - m)); f(expf(a.w - m));
      if (has_b) { f(expf(b.x - m)); f(expf(b.y - m)); f(expf(b.z - m)); f(expf(b.w - m)); }
    }
  } else {
    for (int v = threadIdx.x; v < V; v += kThreads) f(expf(__ldcg(z + v) - m));
  }
}

// One radix digit for select `which` (warp `which` runs it): picks the lowest non-empty
// bin whose starting weight (weight of all keys above it) is below the threshold.
// Weight = count gives the k-th largest key; weight = mass gives the top-p cutoff.
__device__ void radix_walk(SampleSmem* s, int which, int shift, bool first_pass, float top_p) {
  const int lane = threadIdx.x % kWarpSize;
  Select& st = s->sel[which];
  unsigned long long own[8], lane_total = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    own[i] = s->hist[which][kBins - 1 - 8 * lane - i];
    lane_total += own[i];
  }
  unsigned long long threshold = st.threshold;
  if (first_pass && which == 1) {
    unsigned long long total = lane_total;
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1) total += __shfl_xor_sync(kFullMask, total, o);
    threshold = static_cast<unsigned long long>(static_cast<double>(top_p) * static_cast<double>(total));
    if (threshold == 0) threshold = 1;
  }
  const unsigned long long incl = warp_inclusive_scan_u64(lane_total);
  unsigned long long start = st.above + (incl - lane_total);
  int cand = INT_MAX;
  unsigned long long cand_start = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (own[i] > 0 && start < threshold) {
      cand = kBins - 1 - 8 * lane - i;
      cand_start = start;
    }
    start += own[i];
  }
  int best = cand;
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) best = min(best, __shfl_xor_sync(kFullMask, best, o));
  __syncwarp();  // every lane has read st before the winner updates it
  if (best == INT_MAX) {
    if (lane == 0) st.active = 0;  // unreachable for valid rows; keeps every token
  } else if (cand == best) {
    st.prefix |= static_cast<unsigned int>(best) << shift;
    st.mask |= 0xffu << shift;
    st.above = cand_start;
    st.threshold = threshold;
  }
}

// Cutoff on e = exp(z - m) implied by top-k (k-th largest e) and top-p (smallest e whose
// strictly larger tokens carry mass < p); 0 when neither applies.
__device__ float radix_cutoff(const float* z, int V, float m, bool use_k, int64_t k, bool use_p,
                              float top_p, SampleSmem* s) {
  if (threadIdx.x < 2) {
    Select& st = s->sel[threadIdx.x];
    st.prefix = 0;
    st.mask = 0;
    st.above = 0;
    st.threshold = threadIdx.x == 0 ? static_cast<unsigned long long>(k) : 0ull;
    st.active = threadIdx.x == 0 ? use_k : use_p;
  }
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = threadIdx.x; i < 2 * kBins; i += kThreads) s->hist[i / kBins][i % kBins] = 0ull;
    __syncthreads();
    const Select s0 = s->sel[0], s1 = s->sel[1];
    for_each_e(z, V, m, [&](float e) {
      const unsigned int key = __float_as_uint(e);
      const unsigned int bin = (key >> shift) & 0xffu;
      if (s0.active && (key & s0.mask) == s0.prefix) atomicAdd(&s->hist[0][bin], 1ull);
      if (s1.active && (key & s1.mask) == s1.prefix)
        atomicAdd(&s->hist[1][bin], static_cast<unsigned long long>(__float2ull_rn(e * 4294967296.0f)));
    });
    __syncthreads();
    const int warp = threadIdx.x / kWarpSize;
    if (warp < 2 && s->sel[warp].active) radix_walk(s, warp, shift, pass == 0, top_p);
    __syncthreads();
  }
  float cut = 0.f;
  if (s->sel[0].active) cut = fmaxf(cut, __uint_as_float(s->sel[0].prefix));
  if (s->sel[1].active) cut = fmaxf(cut, __uint_as_float(s->sel[1].prefix));
  __syncthreads();
  return cut;
}

// Inverse-CDF draw among tokens with e >= cut: chunk sums, then a warp scan inside the
// chunk that holds u * total. Returns the token; s->kept receives the kept mass.
__device__ int64_t draw_token(const float* z, int V, float m, float cut, float u, float* chunk_sum,
                              SampleSmem* s) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int nch = ceil_div(V, kChunk);
  for (int c = warp; c < nch; c += kWarps) {
    float acc = 0.f;
#pragma unroll 8
    for (int i = lane; i < kChunk; i += kWarpSize) {
      const int v = c * kChunk + i;
      if (v < V) {
        const float e = expf(__ldcg(z + v) - m);
        if (e >= cut) acc += e;
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) chunk_sum[c] = acc;
  }
  __syncthreads();
  if (warp == 0) {
    float run = 0.f;
    for (int b0 = 0; b0 < nch; b0 += kWarpSize) {
      const float x = b0 + lane < nch ? chunk_sum[b0 + lane] : 0.f;
      run += __shfl_sync(kFullMask, warp_inclusive_scan(x), kWarpSize - 1);
    }
    const float total = run, target = u * total;
    int chosen = -1, last_nonzero = -1;
    float before = 0.f;
    run = 0.f;
    for (int b0 = 0; b0 < nch; b0 += kWarpSize) {
      const float x = b0 + lane < nch ? chunk_sum[b0 + lane] : 0.f;
      const float incl = warp_inclusive_scan(x);
      float excl = __shfl_up_sync(kFullMask, incl, 1);
      if (lane == 0) excl = 0.f;
      const unsigned hit = __ballot_sync(kFullMask, x > 0.f && run + incl > target);
      const unsigned nz = __ballot_sync(kFullMask, x > 0.f);
      if (nz) last_nonzero = b0 + kWarpSize - 1 - __clz(nz);
      if (hit) {
        const int l = __ffs(hit) - 1;
        chosen = b0 + l;
        before = run + __shfl_sync(kFullMask, excl, l);
        break;
      }
      run += __shfl_sync(kFullMask, incl, kWarpSize - 1);
    }
    // u * total can round up to total: then the last token with mass is the answer.
    float local_target = target - before;
    if (chosen < 0) {
      chosen = last_nonzero;
      local_target = INFINITY;
    }
    int64_t token = -1, last_kept = -1;
    if (chosen >= 0) {
      float crun = 0.f;
      for (int i0 = 0; i0 < kChunk && chosen * kChunk + i0 < V; i0 += kWarpSize) {
        const int v = chosen * kChunk + i0 + lane;
        float e = 0.f;
        if (v < V) {
          e = expf(__ldcg(z + v) - m);
          if (!(e >= cut)) e = 0.f;
        }
        const float incl = warp_inclusive_scan(e);
        const unsigned hit = __ballot_sync(kFullMask, e > 0.f && crun + incl > local_target);
        const unsigned nz = __ballot_sync(kFullMask, e > 0.f);
        if (nz) last_kept = chosen * kChunk + i0 + kWarpSize - 1 - __clz(nz);
        if (hit) {
          token = chosen * kChunk + i0 + __ffs(hit) - 1;
          break;
        }
        crun += __shfl_sync(kFullMask, incl, kWarpSize - 1);
      }
      if (token < 0) token = last_kept;
    }
    if (lane == 0) {
      s->token = token;
      s->kept = total;
    }
  }
  __syncthreads();
  return s->token;
}

template <typename T>
__device__ void rows_phase(const Params<T>& p, int step, int r, unsigned char* smem) {
  SampleSmem* s = reinterpret_cast<SampleSmem*>(smem);
  float* chunk_sum = reinterpret_cast<float*>(smem + sizeof(SampleSmem));
  const float* z = p.probs + (static_cast<size_t>(r) * p.G + step) * p.V;

  float m = -INFINITY;
  int arg = INT_MAX;
  for (int t = threadIdx.x; t < p.num_tiles; t += kThreads) {
    const size_t i = static_cast<size_t>(r) * p.num_tiles + t;
    const float tm = __ldcg(p.tile_max + i);
    const int ta = __ldcg(p.tile_arg + i);
    if (tm > m || (tm == m && ta < arg)) {
      m = tm;
      arg = ta;
    }
  }
  block_argmax(m, arg, s);

  int64_t token = arg;
  float cut = 0.f, kept = 1.f;
  const float temperature = p.temperature[r];
  if (!(temperature < kGreedyTemperature)) {
    const int64_t k = p.top_k[r];
    const float top_p = p.top_p[r], min_p = p.min_p[r];
    const bool use_k = k > 0 && k < p.V, use_p = top_p < 1.f;
    if (use_k || use_p) cut = radix_cutoff(z, p.V, m, use_k, k, use_p, top_p, s);
    if (min_p > 0.f) cut = fmaxf(cut, min_p);  // min_p * max prob is min_p in e units
    token = draw_token(z, p.V, m, cut, p.uniforms[static_cast<size_t>(r) * p.G + step], chunk_sum, s);
    kept = s->kept;
    if (token < 0) token = arg;
  }

  float conf = 0.f;
  if (p.conf_w != nullptr) {
    int64_t prev = step == 0 ? p.anchor[r] : ld_cg(p.prev + r);
    prev = prev < 0 ? 0 : (prev >= p.V ? p.V - 1 : prev);
    const T* h = p.hidden + (static_cast<size_t>(r) * p.G + step) * p.d;
    const T* e = p.w1 + prev * p.rank;
    float acc = 0.f;
    for (int i = threadIdx.x; i < p.d; i += kThreads) acc = fmaf(to_float(h[i]), to_float(p.conf_w[i]), acc);
    for (int j = threadIdx.x; j < p.rank; j += kThreads)
      acc = fmaf(to_float(e[j]), to_float(p.conf_w[p.d + j]), acc);
    conf = block_sum(acc, s) + to_float(*p.conf_b);
  }
  __syncthreads();  // x_{k-1} reads above finish before prev is overwritten
  if (threadIdx.x == 0) {
    const size_t o = static_cast<size_t>(r) * p.G + step;
    p.tokens[o] = token;
    p.conf[o] = conf;
    p.prev[r] = token;
    p.fin_max[r] = m;
    p.fin_cut[r] = cut;
    p.fin_sum[r] = kept;
    p.fin_arg[r] = arg;
  }
  __syncthreads();
}

// ---------------------------------------------------------------- kernels

template <typename T>
__global__ void __launch_bounds__(kThreads) persistent_kernel(Params<T> p) {
  extern __shared__ __align__(128) unsigned char smem[];
  cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  for (int step = 0; step <= p.G; ++step) {
    tiles_phase(p, step, smem, blockIdx.x, gridDim.x);
    if (step == p.G) break;
    grid.sync();
    for (int r = blockIdx.x; r < p.R; r += gridDim.x) rows_phase(p, step, r, smem);
    grid.sync();
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) tiles_kernel(Params<T> p, int step) {
  extern __shared__ __align__(128) unsigned char smem[];
  tiles_phase(p, step, smem, blockIdx.x, gridDim.x);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rows_kernel(Params<T> p, int step) {
  extern __shared__ __align__(128) unsigned char smem[];
  rows_phase(p, step, blockIdx.x, smem);
}

// ---------------------------------------------------------------- host launcher

enum class LaunchMode : int { kAuto = 0, kPersistent = 1, kPerPhase = 2 };

template <typename T>
inline int max_rows_per_launch() { return kScalarPath<T> ? kMaxRows32 : kMaxRows16; }

inline size_t workspace_bytes(int rows, int V) {
  const size_t tiles = static_cast<size_t>(ceil_div(V, kTileV));
  return rows * (sizeof(int64_t) + 3 * sizeof(float) + sizeof(int)) +
         rows * tiles * (sizeof(float) + sizeof(int));
}

// Launches the fused sampler over all R requests of `p` (workspace pointers are ignored
// and carved from `workspace`, which must hold workspace_bytes(min(R, max rows), V)).
// No host synchronisation: safe inside CUDA graph capture.
template <typename T>
cudaError_t launch(Params<T> p, void* workspace, LaunchMode mode, cudaStream_t stream) {
  if (p.R == 0 || p.G == 0) return cudaSuccess;
  int device = 0, sms = 0, coop = 0, max_smem = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;

  // Fewer requests per launch when a large rank would overflow shared memory.
  int rows_max = max_rows_per_launch<T>();
  while (rows_max > 16 && tile_smem_bytes<T>(rows_max, p.rank) > static_cast<size_t>(max_smem)) rows_max -= 16;
  p.num_tiles = ceil_div(p.V, kTileV);
  for (int r0 = 0; r0 < p.R; r0 += rows_max) {
    Params<T> q = p;
    q.R = std::min(rows_max, p.R - r0);
    q.rows_pad = round_up(q.R, 16);
    const size_t o1 = static_cast<size_t>(r0), og = o1 * p.G;
    q.base_logits += og * p.V;
    if (q.hidden != nullptr) q.hidden += og * p.d;
    q.anchor += o1;
    q.temperature += o1;
    q.top_k += o1;
    q.top_p += o1;
    q.min_p += o1;
    q.uniforms += og;
    q.tokens += og;
    q.probs += og * p.V;
    q.conf += og;
    unsigned char* w = static_cast<unsigned char*>(workspace);
    q.prev = reinterpret_cast<int64_t*>(w);
    w += q.R * sizeof(int64_t);
    q.fin_max = reinterpret_cast<float*>(w);
    q.fin_cut = q.fin_max + q.R;
    q.fin_sum = q.fin_cut + q.R;
    q.fin_arg = reinterpret_cast<int*>(q.fin_sum + q.R);
    q.tile_max = reinterpret_cast<float*>(q.fin_arg + q.R);
    q.tile_arg = reinterpret_cast<int*>(q.tile_max + static_cast<size_t>(q.R) * q.num_tiles);

    const size_t smem = std::max(tile_smem_bytes<T>(q.rows_pad, q.rank), sample_smem_bytes(q.V));
    if (smem > static_cast<size_t>(max_smem)) return cudaErrorInvalidConfiguration;

    bool persistent = mode != LaunchMode::kPerPhase && coop != 0;
    int grid = std::max(q.num_tiles, q.R);
    if (persistent) {
      int per_sm = 0;
      err = ensure_dynamic_smem(reinterpret_cast<const void*>(persistent_kernel<T>), smem);
      if (err == cudaSuccess)
        err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent_kernel<T>, kThreads, smem);
      if (err != cudaSuccess) return err;
      persistent = per_sm > 0;
      grid = std::min(grid, per_sm * sms);
    }
    if (mode == LaunchMode::kPersistent && !persistent) return cudaErrorCooperativeLaunchTooLarge;
    if (persistent) {
      void* args[] = {&q};
      err = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(persistent_kernel<T>), dim3(grid),
                                        dim3(kThreads), args, smem, stream);
      if (err != cudaSuccess) return err;
      continue;
    }
    err = ensure_dynamic_smem(reinterpret_cast<const void*>(tiles_kernel<T>), smem);
    if (err == cudaSuccess) err = ensure_dynamic_smem(reinterpret_cast<const void*>(rows_kernel<T>), smem);
    if (err != cudaSuccess) return err;
    for (int step = 0; step <= q.G; ++step) {
      tiles_kernel<T><<<q.num_tiles, kThreads, smem, stream>>>(q, step);
      if (step < q.G) rows_kernel<T><<<q.R, kThreads, smem, stream>>>(q, step);
    }
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace markov
}  // namespace dspark
