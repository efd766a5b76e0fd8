// Rows phase of the fused Markov sampler: one block per request finds the row max,
// the top-k / top-p cutoffs (radix select), draws the token by inverse CDF and computes
// the Eq 7 confidence logit.
#pragma once

#include "markov_common.cuh"

namespace dspark {
namespace markov {

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

}  // namespace markov
}  // namespace dspark
