// Variable-length verify attention over a paged KV cache (paper Section 5.3).
//
// Queries of all requests in a step are one flat tensor q[T, Hq, D]; marker[t] =
// (slot, position) says whose cache token t reads and where it sits, and token t
// attends to keys 0..position of its slot (its own key included, so the cache must
// already hold the step's K/V). No request is padded to a common length.
//
// One block = (64 query rows, kv head, KV split). A row is (token, query head of the
// kv head's GQA group), so K/V pages are read once for the whole group. Tokens of one
// tile usually share a slot; when they do not, the tile runs once per distinct slot
// with the other rows masked. Long contexts are split over blockIdx.z; partial
// results (normalised O and log2-sum-exp) are merged by a second kernel. Tensor cores
// via WMMA; the online softmax runs on a shared-memory copy of S.
#pragma once

#include <mma.h>

#include <algorithm>
#include <climits>
#include <cstddef>

#include "common.cuh"

namespace dspark {
namespace attn {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kBlockM = 64;  // query rows per block, 16 per warp
constexpr int kBlockN = 64;  // keys per iteration
constexpr int kSLd = kBlockN + 4;  // float stride of S; P (16-bit) aliases S with 2x the stride
constexpr int kMaxSplits = 64;
constexpr float kLog2e = 1.4426950408889634f;

enum RowState : int { kInvalid = 0, kPending = 1, kActive = 2, kDone = 3 };

template <typename T>
struct Params {
  const T* q;              // [T, Hq, D] contiguous
  const int* marker;       // [T, 2] (slot, position)
  const T* k_cache;        // [num_pages, page_size, Hkv, D] with the strides below
  const T* v_cache;
  const int* page_table;   // [num_slots, max_pages]
  T* out;                  // [T, Hq, D] contiguous
  float* part_o;           // [splits, T, Hq, D]  (splits > 1)
  float* part_lse;         // [splits, T, Hq]     log2 domain
  int64_t k_stride_page, k_stride_token, k_stride_head;  // elements
  int64_t v_stride_page, v_stride_token, v_stride_head;
  int num_tokens, hq, hkv, group, tokens_per_tile, page_size, max_pages, num_slots, num_pages, splits;
  float scale_log2;        // softmax scale * log2(e)
};

template <int D>
struct Smem {
  static constexpr int kLd = D + 8;   // 16-bit row stride of Q, K, V
  static constexpr int kOLd = D + 4;  // float row stride of O
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + size_t(kBlockM) * kLd * 2;
  static constexpr size_t kV = kK + size_t(kBlockN) * kLd * 2;
  static constexpr size_t kS = kV + size_t(kBlockN) * kLd * 2;
  static constexpr size_t kO = kS + size_t(kBlockM) * kSLd * 4;
  static constexpr size_t kRowMax = kO + size_t(kBlockM) * kOLd * 4;
  static constexpr size_t kRowSum = kRowMax + kBlockM * 4;
  static constexpr size_t kPos = kRowSum + kBlockM * 4;
  static constexpr size_t kSlot = kPos + kBlockM * 4;
  static constexpr size_t kState = kSlot + kBlockM * 4;
  static constexpr size_t kSeg = kState + kBlockM * 4;  // [0] slot, [1] length
  static constexpr size_t kBytes = kSeg + 2 * 4;
};

template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(const Params<T>& p, int hk, int slot, int n0, int kv_end,
                                             T* Ks, T* Vs) {
  constexpr int kVecs = D / 8;  // 16-byte vectors per row
  constexpr int kLd = Smem<D>::kLd;
  for (int idx = threadIdx.x; idx < kBlockN * kVecs; idx += kThreads) {
    const int row = idx / kVecs, vec = idx % kVecs, key = n0 + row;
    uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
    if (key < kv_end) {
      const int page = p.page_table[static_cast<int64_t>(slot) * p.max_pages + key / p.page_size];
      if (page >= 0 && page < p.num_pages) {
        const int in_page = key % p.page_size;
        kv = *reinterpret_cast<const uint4*>(p.k_cache + page * p.k_stride_page + in_page * p.k_stride_token +
                                             hk * p.k_stride_head + vec * 8);
        vv = *reinterpret_cast<const uint4*>(p.v_cache + page * p.v_stride_page + in_page * p.v_stride_token +
                                             hk * p.v_stride_head + vec * 8);
      }
    }
    *reinterpret_cast<uint4*>(Ks + row * kLd + vec * 8) = kv;
    *reinterpret_cast<uint4*>(Vs + row * kLd + vec * 8) = vv;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_kernel(Params<T> p) {
  using namespace nvcuda;
  using S = Smem<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem + S::kQ);
  T* Ks = reinterpret_cast<T*>(smem + S::kK);
  T* Vs = reinterpret_cast<T*>(smem + S::kV);
  float* Ss = reinterpret_cast<float*>(smem + S::kS);
  T* Ps = reinterpret_cast<T*>(smem + S::kS);  // row r of P overwrites row r of S once read
  constexpr int kPLd = 2 * kSLd;
  float* Os = reinterpret_cast<float*>(smem + S::kO);
  float* row_max = reinterpret_cast<float*>(smem + S::kRowMax);
  float* row_sum = reinterpret_cast<float*>(smem + S::kRowSum);
  int* row_pos = reinterpret_cast<int*>(smem + S::kPos);
  int* row_slot = reinterpret_cast<int*>(smem + S::kSlot);
  int* row_state = reinterpret_cast<int*>(smem + S::kState);
  int* seg = reinterpret_cast<int*>(smem + S::kSeg);

  const int hk = blockIdx.y, split = blockIdx.z;
  const int t0 = blockIdx.x * p.tokens_per_tile;
  const int rows = p.tokens_per_tile * p.group;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int capacity = p.max_pages * p.page_size;

  for (int m = threadIdx.x; m < kBlockM; m += kThreads) {
    const int t = t0 + m / p.group;
    int state = kInvalid, slot = -1, pos = -1;
    if (m < rows && t < p.num_tokens) {
      slot = p.marker[2 * t];
      pos = p.marker[2 * t + 1];
      if (slot >= 0 && slot < p.num_slots && pos >= 0) state = kPending;
    }
    row_state[m] = state;
    row_slot[m] = slot;
    row_pos[m] = min(pos, capacity - 1);
    row_max[m] = -INFINITY;
    row_sum[m] = 0.f;
  }
  constexpr int kVecs = D / 8;
  for (int idx = threadIdx.x; idx < kBlockM * kVecs; idx += kThreads) {
    const int m = idx / kVecs, vec = idx % kVecs, t = t0 + m / p.group;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (m < rows && t < p.num_tokens) {
      const int h = hk * p.group + m % p.group;
      v = *reinterpret_cast<const uint4*>(p.q + (static_cast<int64_t>(t) * p.hq + h) * D + vec * 8);
    }
    *reinterpret_cast<uint4*>(Qs + m * S::kLd + vec * 8) = v;
  }
  for (int idx = threadIdx.x; idx < kBlockM * S::kOLd; idx += kThreads) Os[idx] = 0.f;
  __syncthreads();

  while (true) {
    if (threadIdx.x == 0) {
      int slot = -1, len = 0;
      for (int m = 0; m < kBlockM; ++m) {
        if (row_state[m] != kPending) continue;
        if (slot < 0) slot = row_slot[m];
        if (row_slot[m] == slot) {
          row_state[m] = kActive;
          len = max(len, row_pos[m] + 1);
        }
      }
      seg[0] = slot;
      seg[1] = len;
    }
    __syncthreads();
    const int slot = seg[0];
    if (slot < 0) break;
    const int kv_len = seg[1];
    const int chunk = round_up(ceil_div(kv_len, p.splits), kBlockN);
    const int kv_begin = split * chunk, kv_end = min(kv_len, kv_begin + chunk);

    for (int n0 = kv_begin; n0 < kv_end; n0 += kBlockN) {
      load_kv_tile<T, D>(p, hk, slot, n0, kv_end, Ks, Vs);
      __syncthreads();
      // S = Q K^T for this warp's 16 rows.
      for (int nb = 0; nb < kBlockN / 16; ++nb) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.f);
#pragma unroll
        for (int kk = 0; kk < D; kk += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
          wmma::load_matrix_sync(a, Qs + warp * 16 * S::kLd + kk, S::kLd);
          wmma::load_matrix_sync(b, Ks + nb * 16 * S::kLd + kk, S::kLd);
          wmma::mma_sync(acc, a, b, acc);
        }
        wmma::store_matrix_sync(Ss + warp * 16 * kSLd + nb * 16, acc, kSLd, wmma::mem_row_major);
      }
      __syncwarp();
      // Online softmax over the warp's rows; P replaces S in place.
      for (int rr = 0; rr < 16; ++rr) {
        const int r = warp * 16 + rr;
        const bool active = row_state[r] == kActive;
        const int pos = row_pos[r];
        float s[kBlockN / kWarpSize];
        float mx = -INFINITY;
#pragma unroll
        for (int h = 0; h < kBlockN / kWarpSize; ++h) {
          const int c = lane + kWarpSize * h, key = n0 + c;
          const bool visible = active && key < kv_end && key <= pos;
          s[h] = visible ? Ss[r * kSLd + c] * p.scale_log2 : -INFINITY;
          mx = fmaxf(mx, s[h]);
        }
        mx = warp_max(mx);
        const float m_old = row_max[r];
        const float m_new = fmaxf(m_old, mx);
        const bool any = m_new != -INFINITY;
        const float alpha = any ? exp2f(m_old - m_new) : 1.f;
        float sum = 0.f;
#pragma unroll
        for (int h = 0; h < kBlockN / kWarpSize; ++h) {
          s[h] = any && s[h] != -INFINITY ? exp2f(s[h] - m_new) : 0.f;
          sum += s[h];
        }
        sum = warp_sum(sum);
        __syncwarp();  // all lanes have read row r of S before P overwrites it
#pragma unroll
        for (int h = 0; h < kBlockN / kWarpSize; ++h) Ps[r * kPLd + lane + kWarpSize * h] = from_float<T>(s[h]);
        if (alpha != 1.f) {
          for (int d = lane; d < D; d += kWarpSize) Os[r * S::kOLd + d] *= alpha;
        }
        if (lane == 0) {
          row_max[r] = m_new;
          row_sum[r] = row_sum[r] * alpha + sum;
        }
      }
      __syncwarp();
      // O += P V for this warp's rows.
      for (int nb = 0; nb < D / 16; ++nb) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::load_matrix_sync(acc, Os + warp * 16 * S::kOLd + nb * 16, S::kOLd, wmma::mem_row_major);
#pragma unroll
        for (int kk = 0; kk < kBlockN; kk += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
          wmma::load_matrix_sync(a, Ps + warp * 16 * kPLd + kk, kPLd);
          wmma::load_matrix_sync(b, Vs + kk * S::kLd + nb * 16, S::kLd);
          wmma::mma_sync(acc, a, b, acc);
        }
        wmma::store_matrix_sync(Os + warp * 16 * S::kOLd + nb * 16, acc, S::kOLd, wmma::mem_row_major);
      }
      __syncthreads();  // K/V and S/P are overwritten next iteration
    }
    for (int m = threadIdx.x; m < kBlockM; m += kThreads)
      if (row_state[m] == kActive) row_state[m] = kDone;
    __syncthreads();
  }

  // Every (token, head) of the tile is written, rows without keys as zeros.
  for (int idx = threadIdx.x; idx < rows * D; idx += kThreads) {
    const int m = idx / D, d = idx % D, t = t0 + m / p.group;
    if (t >= p.num_tokens) continue;
    const int h = hk * p.group + m % p.group;
    const float l = row_sum[m];
    const float o = l > 0.f ? Os[m * S::kOLd + d] / l : 0.f;
    const int64_t oi = (static_cast<int64_t>(t) * p.hq + h) * D + d;
    if (p.splits == 1) {
      p.out[oi] = from_float<T>(o);
    } else {
      p.part_o[static_cast<int64_t>(split) * p.num_tokens * p.hq * D + oi] = o;
      if (d == 0)
        p.part_lse[(static_cast<int64_t>(split) * p.num_tokens + t) * p.hq + h] =
            l > 0.f ? row_max[m] + log2f(l) : -INFINITY;
    }
  }
}

// One warp per (token, head): out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) combine_kernel(Params<T> p) {
  const int pair = blockIdx.x * kWarps + threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  if (pair >= p.num_tokens * p.hq) return;
  const int64_t split_stride = static_cast<int64_t>(p.num_tokens) * p.hq;
  float mx = -INFINITY;
  for (int s = 0; s < p.splits; ++s) mx = fmaxf(mx, p.part_lse[s * split_stride + pair]);
  float acc[D / kWarpSize] = {};
  float den = 0.f;
  if (mx != -INFINITY) {
    for (int s = 0; s < p.splits; ++s) {
      const float lse = p.part_lse[s * split_stride + pair];
      if (lse == -INFINITY) continue;
      const float w = exp2f(lse - mx);
      den += w;
      const float* o = p.part_o + (s * split_stride + pair) * D;
#pragma unroll
      for (int i = 0; i < D / kWarpSize; ++i) acc[i] = fmaf(w, o[lane + kWarpSize * i], acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < D / kWarpSize; ++i)
    p.out[static_cast<int64_t>(pair) * D + lane + kWarpSize * i] = from_float<T>(den > 0.f ? acc[i] / den : 0.f);
}

// Splits when the (tile x kv head) grid alone would leave SMs idle; bounded by the static
// context capacity so that no split is shorter than 256 keys at full capacity.
inline int auto_splits(int tiles, int hkv, int capacity, int sms) {
  const int blocks = tiles * hkv;
  if (blocks >= 2 * sms) return 1;
  const int want = ceil_div(2 * sms, std::max(blocks, 1));
  return std::max(1, std::min({want, kMaxSplits, ceil_div(capacity, 256)}));
}

inline int tokens_per_tile(int group) { return std::max(1, kBlockM / group); }

// p.splits > 1 needs p.part_o / p.part_lse. No host synchronisation.
template <typename T, int D>
cudaError_t launch(const Params<T>& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const size_t smem = Smem<D>::kBytes;
  cudaError_t err = ensure_dynamic_smem(reinterpret_cast<const void*>(attention_kernel<T, D>), smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(ceil_div(p.num_tokens, p.tokens_per_tile), p.hkv, p.splits);
  attention_kernel<T, D><<<grid, kThreads, smem, stream>>>(p);
  if (p.splits > 1) {
    const int pairs = p.num_tokens * p.hq;
    combine_kernel<T, D><<<ceil_div(pairs, kWarps), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace attn
}  // namespace dspark
