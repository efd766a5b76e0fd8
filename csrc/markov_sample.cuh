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
//   tiles (markov_tiles.cuh): each block takes 64-column vocabulary tiles; a W2 tile is
//     read once for all requests (tensor-core GEMM for fp16/bf16), scaled logits
//     z = logits / T go into the probs buffer, per-tile max/argmax into the workspace.
//     The same pass turns the previous step's z into final probabilities.
//   rows (markov_rows.cuh): one block per request: row max, top-k / top-p cutoffs by a
//     4-pass radix select over e = exp(z - max) (top-p masses in 2^-32 fixed point, so
//     the result does not depend on atomic order), the inverse-CDF draw over 1024-token
//     chunks, and the confidence logit.
#pragma once

#include <cooperative_groups.h>

#include <algorithm>

#include "markov_common.cuh"
#include "markov_rows.cuh"
#include "markov_tiles.cuh"

namespace dspark {
namespace markov {

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
      if (err == cudaSuccess) continue;
      // Auto mode: a grid the occupancy query allowed can still be refused (e.g. MPS SM
      // limits); then run per phase rather than fail the step.
      if (mode == LaunchMode::kPersistent || err != cudaErrorCooperativeLaunchTooLarge) return err;
      (void)cudaGetLastError();
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
