// Quantized linear layers for CPU decode steps: y[M, N] = x[M, K] @ W[N, K]^T with W in groups
// of 32 weights per row, 4-bit (GGUF Q4_1's grid: w = d * q + m, q in 0..15) or 8-bit (Q8_0's:
// w = d * q, q in -127..127, stored as q + 128), one float16 d (and m) per group, and x
// quantized per row and group of 32 to int8 (x ~ dx * qx, qx = round(x / dx),
// dx = max |x| / 127: GGUF Q8_1's rule, what llama.cpp multiplies these weights by). Integer
// dot products (AVX512-VNNI vpdpbusd, or its AVX2 emulation) over a group, then per group in
// float32:
//   4-bit: y[r, n] += (d[n, g] dx[r, g]) sum_k q[n, k] qx[r, k] + m[n, g] (dx[r, g] sum_k qx[r, k])
//   8-bit: y[r, n] += (d[n, g] dx[r, g]) (sum_k (q[n, k] + 128) qx[r, k] - 128 sum_k qx[r, k])
// Why: torch's int4 CPU kernel converts every weight to floating point for every 4 rows, so a
// verify block of 8 tokens costs 3x one token; here a weight block is unpacked once per 8 rows
// and each row adds 8 vpdpbusd per 512 weights, so the cost grows slowly with the rows (the
// premise of speculative decoding: verifying gamma + 1 tokens costs about as much as one).
// Row invariance: a row's output depends on that row only (its own quantization, exact integer
// sums, float32 updates in group order), whatever the row and thread counts.
// PyTorch reference and packing: dspark_serve/ops/quantized_linear.py.
// Instruction sets: the kernels (kernels.inc) are compiled twice, for AVX512-VNNI and for AVX2 +
// FMA + F16C (avx2_emulation.h: each 512-bit operation as two 256-bit ones), and the module binds
// the best one this CPU runs when it is imported.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr int kGroup = 32;   // weights per scale pair (and activations per int8 scale)
constexpr int kLanes = 16;   // output channels per block (one zmm of int32 / float32)
template <int Bits>
constexpr int kBlockBytes = kLanes * kGroup * Bits / 8;   // packed bytes of one weight block
// How many blocks ahead of use the weights are prefetched (8 to 32 measured alike; a block of
// 4-bit weights is 256 bytes). Prefetches past the weight's end are harmless (no fault).
constexpr int kPrefetchGroups = 16;

}  // namespace

namespace avx512 {
#include "avx512_native.h"
#include "kernels.inc"
#undef DSPARK_SIMD
}  // namespace avx512

namespace avx2 {
#include "avx2_emulation.h"
#include "kernels.inc"
#undef DSPARK_SIMD
}  // namespace avx2

namespace {

// The instruction set the bound kernels use: "avx512-vnni", "avx2" or "" (none runs here).
const char* cpu_isa() {
  return avx512::isa_supported() ? "avx512-vnni" : avx2::isa_supported() ? "avx2" : "";
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const bool vnni = avx512::isa_supported();
  m.def("supported", [] { return *cpu_isa() != '\0'; },
        "whether this CPU has the instructions the kernels need");
  m.def("isa", &cpu_isa, "the instruction set of the bound kernels (empty: none runs here)");
  m.def("quantized_linear", vnni ? &avx512::quantized_linear : &avx2::quantized_linear,
        "y = x @ W^T, W in 4- or 8-bit groups of 32, x quantized to int8 per group of 32");
  m.def("decoder_layer", vnni ? &avx512::decoder_layer : &avx2::decoder_layer,
        "one decoder layer with quantized projections");
  m.def("draft_layer", vnni ? &avx512::draft_layer : &avx2::draft_layer,
        "one DFlash draft layer with quantized projections");
  m.def("draft_context", vnni ? &avx512::draft_context : &avx2::draft_context,
        "the drafter's context states, keys and values");
  m.def("markov_draw", vnni ? &avx512::markov_draw : &avx2::markov_draw,
        "the Markov head's left-to-right draw of a draft block");
}
