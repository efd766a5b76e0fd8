// Quantized linear layers for CPU decode steps: y[M, N] = x[M, K] @ W[N, K]^T with W in groups
// of 32 weights per row, 4-bit (GGUF Q4_1's grid: w = d * q + m, q in 0..15) or 8-bit (Q8_0's:
// w = d * q, q in -127..127, stored as q + 128), one float16 d (and m) per group, and x
// quantized per row and group of 32 to int8 (x ~ dx * qx, qx = round(x / dx),
// dx = max |x| / 127: GGUF Q8_1's rule, what llama.cpp multiplies these weights by). Integer
// dot products (AVX512-VNNI vpdpbusd) over a group, then per group in float32:
//   4-bit: y[r, n] += (d[n, g] dx[r, g]) sum_k q[n, k] qx[r, k] + m[n, g] (dx[r, g] sum_k qx[r, k])
//   8-bit: y[r, n] += (d[n, g] dx[r, g]) (sum_k (q[n, k] + 128) qx[r, k] - 128 sum_k qx[r, k])
// Why: torch's int4 CPU kernel converts every weight to floating point for every 4 rows, so a
// verify block of 8 tokens costs 3x one token; here a weight block is unpacked once per 8 rows
// and each row adds 8 vpdpbusd per 512 weights, so the cost grows slowly with the rows (the
// premise of speculative decoding: verifying gamma + 1 tokens costs about as much as one).
// Row invariance: a row's output depends on that row only (its own quantization, exact integer
// sums, float32 updates in group order), whatever the row and thread counts.
// PyTorch reference and packing: dspark_serve/ops/quantized_linear.py.
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
constexpr int kRowTile = 8;  // rows sharing one unpacked weight block
template <int Bits>
constexpr int kBlockBytes = kLanes * kGroup * Bits / 8;   // packed bytes of one weight block
// How many blocks ahead of use the weights are prefetched (8 to 32 measured alike; a block of
// 4-bit weights is 256 bytes). Prefetches past the weight's end are harmless (no fault).
constexpr int kPrefetchGroups = 16;

#define DSPARK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

// x [M, K] float32 -> qx [M, K] int8, dx [M, G] (scale), sx [M, G] (dx * sum of qx), and
// qs [M, G] = 128 * sum of qx (the 8-bit path's integer offset).
DSPARK_AVX512 void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx,
                                 float* sx, int32_t* qs) {
  const int64_t G = K / kGroup;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* src = x + r * K + g * kGroup;
      __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      float d = amax / 127.0f;
      __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // round to nearest even
      __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      int8_t* dst = qx + r * K + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi));
      int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      dx[r * G + g] = d;
      sx[r * G + g] = d * static_cast<float>(sum);
      qs[r * G + g] = 128 * sum;
    }
  }
}

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

DSPARK_AVX512 inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// e^x for 16 floats: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7), times 2^n; inputs below -104 give 0 (softmax tails, SiLU).
DSPARK_AVX512 inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Rows [r0, r0 + MT) of output block nb (16 channels). vpdpbusd multiplies unsigned weight
// bytes by the signed activations, broadcast straight from memory. Bits 4: the Q4_1 grid
// (w = d q + m: the nibbles, plus the m term). Bits 8: the Q8_0 grid (w = d q, signed), stored
// as q + 128, so the exact integer offset 128 * sum_k qx[r, k] (``qs``) is taken off.
template <int Bits, int MT>
DSPARK_AVX512 void block_rows(const uint8_t* packed, const uint16_t* scales, const int8_t* qx,
                              const float* dx, const float* sx, const int32_t* qs, int64_t nb,
                              int64_t r0, int64_t G, int64_t K, int64_t N, float* y) {
  __m512 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t block = nb * G + g;
    const uint8_t* wb = packed + block * kBlockBytes<Bits>;
    const uint16_t* sb = scales + block * kLanes * (Bits == 4 ? 2 : 1);
    // The weights stream from memory once per step (60 MB for SmolLM2-135M); the hardware
    // prefetcher alone leaves the core waiting on them between blocks, so ask for the block
    // kPrefetchGroups ahead (one user's step 11.8 -> 10.6 ms, 8 rows 20.0 -> 16.4 ms).
    for (int l = 0; l < kBlockBytes<Bits>; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchGroups * kBlockBytes<Bits> + l),
                   _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(sb + kPrefetchGroups * kLanes * (Bits == 4 ? 2 : 1)),
                 _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    __m512 m = _mm512_setzero_ps();
    __m512i w[8];
    if constexpr (Bits == 4) {
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kLanes)));
      for (int u = 0; u < 4; ++u) {
        __m512i p = _mm512_loadu_si512(wb + 64 * u);
        w[2 * u] = _mm512_and_si512(p, low4);
        w[2 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
      }
    } else {
      for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(wb + 64 * t);
    }
    // unrolled, so the accumulators stay in registers (GCC kept the 8-bit ones on the stack)
#pragma GCC unroll 16
    for (int r = 0; r < MT; ++r) {
      const int8_t* xq = qx + (r0 + r) * K + g * kGroup;
      // two accumulation chains: vpdpbusd's latency, not its throughput, bounds a few rows
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
      for (int t = 0; t < 8; t += 2) {
        // one 4-byte load per broadcast, so it folds into vpdpbusd's {1to16} memory operand
        // (an 8-byte load split in general registers cost 3 extra instructions per broadcast)
        int32_t x0q, x1q;
        std::memcpy(&x0q, xq + 4 * t, 4);
        std::memcpy(&x1q, xq + 4 * t + 4, 4);
        even = _mm512_dpbusd_epi32(even, w[t], _mm512_set1_epi32(x0q));
        odd = _mm512_dpbusd_epi32(odd, w[t + 1], _mm512_set1_epi32(x1q));
      }
      __m512i isum = _mm512_add_epi32(even, odd);
      const int64_t rg = (r0 + r) * G + g;
      if constexpr (Bits == 8) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(qs[rg]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(dx[rg])),
                               acc[r]);
      if constexpr (Bits == 4) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[rg]), acc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) _mm512_storeu_ps(y + (r0 + r) * N + nb * kLanes, acc[r]);
}

using RowsFn = void (*)(const uint8_t*, const uint16_t*, const int8_t*, const float*,
                        const float*, const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                        float*);

template <int Bits, int... Ms>
RowsFn rows_fn(int64_t mt, std::integer_sequence<int, Ms...>) {
  RowsFn fn = nullptr;
  ((mt == Ms + 1 ? (fn = &block_rows<Bits, Ms + 1>) : nullptr), ...);
  return fn;
}

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// A quantized weight as Python passes it: (packed, scales, bits), layouts as in
// dspark_serve/ops/quantized_linear.py (QuantizedWeight).
using QTuple = std::tuple<at::Tensor, at::Tensor, int64_t>;

struct QWeight {
  const uint8_t* packed;
  const uint16_t* scales;
  int64_t bits, N, K, G;
};

QWeight check_weight(const QTuple& w, const char* name) {
  const auto& [packed, scales, bits] = w;
  TORCH_CHECK(bits == 4 || bits == 8, name, ": bits must be 4 or 8, got ", bits);
  const int64_t NB = packed.size(0), G = packed.size(1), quads = bits == 4 ? 4 : 8;
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous() && packed.sizes() == at::IntArrayRef({NB, G, quads, kLanes, 4}),
              name, ": packed must be contiguous uint8 [N / 16, K / 32, ", quads, ", 16, 4]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == NB * G * kLanes * (bits == 4 ? 2 : 1),
              name, ": scales must be contiguous float16, one (bits 8) or two (bits 4) per group");
  return {packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()), bits,
          NB * kLanes, G * kGroup, G};
}

// y [M, N] float32 = x [M, K] float32 @ W^T (+ bias [N] bfloat16).
void qlinear(const float* x, int64_t M, const QWeight& w, const at::Tensor* bias, float* y) {
  const int64_t K = w.K, G = w.G, N = w.N, NB = N / kLanes;
  std::vector<int8_t> qx(M * K);
  std::vector<float> dx(M * G), sx(M * G);
  std::vector<int32_t> qs(M * G);
  quantize_rows(x, M, K, qx.data(), dx.data(), sx.data(), qs.data());
  const auto tiles = std::make_integer_sequence<int, kRowTile>{};
  RowsFn full = w.bits == 4 ? rows_fn<4>(kRowTile, tiles) : rows_fn<8>(kRowTile, tiles);
  const int64_t rest = M % kRowTile;
  RowsFn last = rest == 0 ? nullptr : w.bits == 4 ? rows_fn<4>(rest, tiles) : rows_fn<8>(rest, tiles);
  // Threads split the output channels, so each output is computed by one thread in one order.
  at::parallel_for(0, NB, 16, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      int64_t r0 = 0;
      for (; r0 + kRowTile <= M; r0 += kRowTile)
        full(w.packed, w.scales, qx.data(), dx.data(), sx.data(), qs.data(), nb, r0, G, K, N, y);
      if (last != nullptr)
        last(w.packed, w.scales, qx.data(), dx.data(), sx.data(), qs.data(), nb, r0, G, K, N, y);
    }
  });
  if (bias != nullptr) {
    const auto* b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
    for (int64_t r = 0; r < M; ++r)
      for (int64_t n = 0; n < N; ++n) y[r * N + n] += bf16_to_float(b[n]);
  }
}

void check_bias(const std::optional<at::Tensor>& bias, int64_t n, const char* name) {
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                        bias->numel() == n),
              name, " bias must be contiguous bfloat16 [", n, "]");
}

}  // namespace

// y [M, N] bfloat16 = x [M, K] bfloat16 @ W^T.
at::Tensor quantized_linear(const at::Tensor& x, const QTuple& weight) {
  TORCH_CHECK(cpu_supported(), "quantized_linear needs AVX512-VNNI");
  const QWeight w = check_weight(weight, "weight");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "x must be a 2-D bfloat16 CPU tensor");
  TORCH_CHECK(x.size(1) == w.K, "x has ", x.size(1), " columns, the weight ", w.K);
  const int64_t M = x.size(0);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor yf = at::empty({M, w.N}, xf.options());
  if (M > 0) qlinear(xf.data_ptr<float>(), M, w, nullptr, yf.data_ptr<float>());
  return yf.to(at::kBFloat16);
}

namespace {

// out [H] float32 = x / rms(x) * weight (x float32; the statistic in float32; H % 16 == 0).
DSPARK_AVX512 void rms_norm_row(const float* x, const uint16_t* weight, int64_t H, float eps,
                                float* out) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / H + eps));
  for (int64_t i = 0; i < H; i += 16)
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv),
                                            load_bf16(weight + i)));
}

// Sums of 16 vectors: lane i of the result = the sum of the 16 lanes of r[i] (a transpose-add
// tree, 45 shuffles and adds instead of 16 horizontal reductions of ~8 instructions each).
DSPARK_AVX512 inline __m512 sum16(const __m512* r) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)   // per 128-bit lane: (a0 + a2, b0 + b2, a1 + a3, b1 + b3)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]),
                         _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
  for (int i = 0; i < 4; ++i)   // per 128-bit lane: the lane sums of four vectors
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Most query heads one attend_group call takes (tokens x heads per KV head).
constexpr int64_t kMaxGroupHeads = 64;

// Floats of attend_group's scratch for groups of up to `heads` query heads over up to `longest`
// keys of head size D.
inline int64_t group_scratch_floats(int64_t heads, int64_t longest, int64_t D) {
  return heads * (longest + 16) + 16 * D + longest * D;
}

// The G query heads that share a KV head, for each of the m tokens of a group that reads the
// same key / value rows (one request's verify or prefill tokens, one draft block): token i
// against keys 0..n[i]-1. key_row(j), value_row(j) give key / value j (bfloat16 [D]; the
// caller's cache layout). q[i]: [G, D] float32 (contiguous heads); out[i]: [G, D]; scratch:
// group_scratch_floats(m * G, max n, D) floats. Keys go 16 at a time: converted to float32
// once for the group, each head's 16 dot products reduced together (``sum16``); values are
// converted once (read straight from bfloat16 when one pass of heads covers the group), each
// head's output kept in registers (16 zmm: 4 heads of 64 or 2 of 128 per pass over the values).
// Every head of every token gets the arithmetic of a token attended alone (fixed blocks of 16
// keys from key 0, its own key count, the same reductions and accumulation order), so a
// token's result depends on its own query and keys only, not on its group: the group shares
// only exact conversions.
template <int D, class KeyRow, class ValueRow>
DSPARK_AVX512 void attend_group(const float* const* q, const int64_t* n, int64_t m, int64_t G,
                                KeyRow key_row, ValueRow value_row, float scale, float* scratch,
                                float* const* out) {
  constexpr int C = D / 16;
  const int64_t H = m * G;
  int64_t longest = 0;
  for (int64_t i = 0; i < m; ++i) longest = std::max(longest, n[i]);
  const int64_t stride = longest + 16;
  float* scores = scratch;                 // [H, stride]
  float* kf = scores + H * stride;         // [16, D] float32 keys of the current block
  float* vf = kf + 16 * D;                 // [longest, D] float32 values (several passes)
  __m512 top[kMaxGroupHeads];
  for (int64_t h = 0; h < H; ++h) top[h] = _mm512_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < longest; j0 += 16) {
    const int64_t block = std::min<int64_t>(16, longest - j0);
    for (int64_t jj = 0; jj < block; ++jj) {
      const uint16_t* kp = key_row(j0 + jj);
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(kf + jj * D + 16 * c, load_bf16(kp + 16 * c));
    }
    for (int64_t i = 0; i < m; ++i) {
      const int64_t count = std::min<int64_t>(16, n[i] - j0);
      if (count <= 0) continue;
      const __mmask16 mk = count == 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = i * G + g;
        __m512 qv[C], part[16];
        for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q[i] + g * D + 16 * c);
        for (int jj = 0; jj < 16; ++jj) {
          if (jj >= count) {
            part[jj] = _mm512_setzero_ps();
            continue;
          }
          __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kf + jj * D));
          for (int c = 1; c < C; ++c)
            acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kf + jj * D + 16 * c), acc);
          part[jj] = acc;
        }
        const __m512 sc = _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores + h * stride + j0, mk, sc);
        top[h] = _mm512_mask_max_ps(top[h], mk, top[h], sc);
      }
    }
  }
  float inv[kMaxGroupHeads];
  for (int64_t h = 0; h < H; ++h) {
    const int64_t nh = n[h / G];
    float* sh = scores + h * stride;
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(top[h]));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < nh; j += 16) {
      const __mmask16 mk = nh - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nh - j)) - 1);
      __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sh + j), mx));
      e = _mm512_maskz_mov_ps(mk, e);
      _mm512_mask_storeu_ps(sh + j, mk, e);
      total = _mm512_add_ps(total, e);
    }
    inv[h] = 1.0f / _mm512_reduce_add_ps(total);
  }
  constexpr int HeadsPerPass = 256 / D;   // output accumulators in 16 registers
  const bool one_pass = H <= HeadsPerPass;
  if (!one_pass)
    for (int64_t j = 0; j < longest; ++j) {
      const uint16_t* vp = value_row(j);
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(vf + j * D + 16 * c, load_bf16(vp + 16 * c));
    }
  for (int64_t h0 = 0; h0 < H; h0 += HeadsPerPass) {
    const int64_t heads = std::min<int64_t>(HeadsPerPass, H - h0);
    int64_t pass_keys = 0, nh[HeadsPerPass];
    for (int64_t h = 0; h < heads; ++h) pass_keys = std::max(pass_keys, nh[h] = n[(h0 + h) / G]);
    __m512 acc[HeadsPerPass][C];
    for (int h = 0; h < HeadsPerPass; ++h)
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pass_keys; ++j) {
      __m512 v[C];
      if (one_pass) {
        const uint16_t* vp = value_row(j);
        for (int c = 0; c < C; ++c) v[c] = load_bf16(vp + 16 * c);
      } else {
        for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vf + j * D + 16 * c);
      }
      for (int h = 0; h < HeadsPerPass; ++h) {
        if (h >= heads) break;
        if (j >= nh[h]) continue;
        const __m512 p = _mm512_set1_ps(scores[(h0 + h) * stride + j]);
        for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(p, v[c], acc[h][c]);
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      const __m512 norm = _mm512_set1_ps(inv[h0 + h]);
      float* o = out[(h0 + h) / G] + ((h0 + h) % G) * D;
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[h][c], norm));
    }
  }
}

// Rotates one head v [D] by RoPE factors c, s [D / 2] (rotate-half convention, as Llama/Qwen).
inline void rope_head(float* v, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * c[i] - b * s[i];
    v[i + half] = b * c[i] + a * s[i];
  }
}

// out [T, I] = silu(gate) * up for gate_up [T, 2I] (gate, then up; I % 16 == 0).
DSPARK_AVX512 void silu_mul(const float* gate_up, int64_t T, int64_t I, float* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gate_up + t * 2 * I;
    for (int64_t i = 0; i < I; i += 16) {
      __m512 x = _mm512_loadu_ps(g + i);
      __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))));
      _mm512_storeu_ps(out + t * I + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_loadu_ps(g + I + i)));
    }
  }
}

}  // namespace

namespace {

// The projections and norms of one decoder layer, checked against h [T, H] and the head layout.
struct LayerWeights {
  QWeight qkv, o, gate_up, down;
  const at::Tensor *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
  const uint16_t *input_norm, *post_norm;
  int64_t T, H, Hq, Hkv, D, I;
};

const at::Tensor* bias_ptr(const std::optional<at::Tensor>& b) { return b ? &*b : nullptr; }

LayerWeights check_layer(const at::Tensor& h, const at::Tensor& input_norm,
                         const at::Tensor& post_norm, const QTuple& qkv,
                         const std::optional<at::Tensor>& qkv_bias, const QTuple& o_proj,
                         const std::optional<at::Tensor>& o_bias, const QTuple& gate_up,
                         const std::optional<at::Tensor>& gate_up_bias, const QTuple& down,
                         const std::optional<at::Tensor>& down_bias, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                         int64_t D) {
  TORCH_CHECK(cpu_supported(), "the fused layers need AVX512-VNNI");
  LayerWeights w{check_weight(qkv, "qkv"), check_weight(o_proj, "o_proj"),
                 check_weight(gate_up, "gate_up"), check_weight(down, "down"),
                 bias_ptr(qkv_bias), bias_ptr(o_bias), bias_ptr(gate_up_bias),
                 bias_ptr(down_bias), nullptr, nullptr, 0, 0, num_heads, num_kv_heads, D, 0};
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kBFloat16 && h.dim() == 2 &&
                  h.is_contiguous(), "h must be a contiguous 2-D bfloat16 CPU tensor");
  w.T = h.size(0);
  w.H = h.size(1);
  w.I = w.gate_up.N / 2;
  const int64_t T = w.T, H = w.H, Hq = w.Hq, Hkv = w.Hkv;
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK((D == 64 || D == 128) && H % 16 == 0,
              "head_dim must be 64 or 128 and the hidden size a multiple of 16");
  TORCH_CHECK(Hq / Hkv <= 16, "at most 16 query heads per KV head");
  TORCH_CHECK(w.qkv.K == H && w.qkv.N == (Hq + 2 * Hkv) * D && w.o.K == Hq * D && w.o.N == H &&
                  w.gate_up.K == H && w.down.K == w.I && w.down.N == H && w.I % 16 == 0,
              "projection shapes do not fit the layer");
  check_bias(qkv_bias, w.qkv.N, "qkv");
  check_bias(o_bias, H, "o_proj");
  check_bias(gate_up_bias, w.gate_up.N, "gate_up");
  check_bias(down_bias, H, "down");
  TORCH_CHECK(input_norm.scalar_type() == at::kBFloat16 && input_norm.numel() == H &&
                  post_norm.scalar_type() == at::kBFloat16 && post_norm.numel() == H &&
                  input_norm.is_contiguous() && post_norm.is_contiguous(),
              "norm weights must be contiguous bfloat16 [H]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() &&
                  cos.sizes() == at::IntArrayRef({T, D / 2}) && sin.sizes() == cos.sizes(),
              "cos, sin must be contiguous float32 [T, D / 2]");
  w.input_norm = reinterpret_cast<const uint16_t*>(input_norm.data_ptr());
  w.post_norm = reinterpret_cast<const uint16_t*>(post_norm.data_ptr());
  return w;
}

// The layer up to attention: resid [T, H] float32 = h, qkv [T, (Hq + 2 Hkv) D] float32 =
// qkv_proj(rms_norm(h)).
void layer_input(const LayerWeights& w, const at::Tensor& h, double eps,
                 std::vector<float>& resid, std::vector<float>& qkv) {
  const int64_t T = w.T, H = w.H;
  const auto* hp = reinterpret_cast<const uint16_t*>(h.data_ptr());
  std::vector<float> x(T * H);
  resid.resize(T * H);
  qkv.resize(T * w.qkv.N);
  for (int64_t i = 0; i < T * H; ++i) resid[i] = bf16_to_float(hp[i]);
  for (int64_t t = 0; t < T; ++t) rms_norm_row(&resid[t * H], w.input_norm, H, eps, &x[t * H]);
  qlinear(x.data(), T, w.qkv, w.qkv_bias, qkv.data());
}

// The layer after attention: h + o_proj(attn), then the SwiGLU MLP with its residual; returns
// the new h [T, H] bfloat16 (options of ``like``).
at::Tensor layer_output(const LayerWeights& w, double eps, std::vector<float>& resid,
                        const std::vector<float>& attn, const at::Tensor& like) {
  const int64_t T = w.T, H = w.H, I = w.I;
  std::vector<float> x(T * H), gu(T * w.gate_up.N), act(T * I), proj(T * H);
  qlinear(attn.data(), T, w.o, w.o_bias, proj.data());
  for (int64_t i = 0; i < T * H; ++i) resid[i] += proj[i];
  for (int64_t t = 0; t < T; ++t) rms_norm_row(&resid[t * H], w.post_norm, H, eps, &x[t * H]);
  qlinear(x.data(), T, w.gate_up, w.gate_up_bias, gu.data());
  silu_mul(gu.data(), T, I, act.data());
  qlinear(act.data(), T, w.down, w.down_bias, proj.data());
  at::Tensor out = at::empty({T, H}, like.options());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t i = 0; i < T * H; ++i) op[i] = float_to_bf16(resid[i] + proj[i]);
  return out;
}

// Attention of every (token, KV head) pair: attend_group<D> over runs of consecutive tokens
// with the same ``group(t)`` (tokens that read the same key / value rows: ``rows(t, kvh)``
// gives them for the run's first token), each token over ``count(t)`` keys.
template <class Rows, class Count, class Group>
void attend_all(const LayerWeights& w, const std::vector<float>& qkv, int64_t longest, double scale,
                Rows rows, Count count, Group group, std::vector<float>& attn) {
  const int64_t T = w.T, Hq = w.Hq, Hkv = w.Hkv, D = w.D, groups = Hq / Hkv;
  const int64_t max_run = std::max<int64_t>(1, kMaxGroupHeads / groups);
  std::vector<int64_t> firsts;   // first token of each run
  for (int64_t t = 0; t < T; ++t)
    if (t == 0 || group(t) != group(t - 1) || t - firsts.back() >= max_run) firsts.push_back(t);
  const int64_t runs = firsts.size();
  firsts.push_back(T);
  int64_t widest = 1;   // tokens in the largest run
  for (int64_t r = 0; r < runs; ++r) widest = std::max(widest, firsts[r + 1] - firsts[r]);
  attn.resize(T * Hq * D);
  at::parallel_for(0, runs * Hkv, 1, [&](int64_t begin, int64_t end) {
    // uninitialised: every float is written before it is read
    std::unique_ptr<float[]> scratch(new float[group_scratch_floats(widest * groups, longest, D)]);
    std::vector<int64_t> n(widest);
    std::vector<const float*> qs(widest);
    std::vector<float*> outs(widest);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t run = i / Hkv, kvh = i % Hkv, t0 = firsts[run], m = firsts[run + 1] - t0;
      auto [key_row, value_row] = rows(t0, kvh);
      for (int64_t k = 0; k < m; ++k) {
        n[k] = count(t0 + k);
        qs[k] = &qkv[(t0 + k) * w.qkv.N + kvh * groups * D];
        outs[k] = &attn[((t0 + k) * Hq + kvh * groups) * D];
      }
      if (D == 64)
        attend_group<64>(qs.data(), n.data(), m, groups, key_row, value_row,
                         static_cast<float>(scale), scratch.get(), outs.data());
      else
        attend_group<128>(qs.data(), n.data(), m, groups, key_row, value_row,
                          static_cast<float>(scale), scratch.get(), outs.data());
    }
  });
}

void check_pages(const at::Tensor& page_table, const char* what) {
  TORCH_CHECK(page_table.scalar_type() == at::kLong && page_table.is_contiguous() &&
                  page_table.dim() == 2, what, ": page_table must be contiguous int64 [S, P]");
}

}  // namespace

// One Llama / Qwen2 decoder layer over T flat tokens with quantized projections (the int4 fast
// path of dspark_serve/model/target_model.py, same contract as its Python layer loop):
// h [T, H] bfloat16 -> new h [T, H] bfloat16, writing the tokens' keys and values into this
// layer's cache k_cache / v_cache [num_pages, Hkv, page_size, D] bfloat16 at
// page_table[slot, position / page_size], position % page_size, then attending causally over
// positions 0..position of each token's slot. cos, sin: [T, D / 2] float32 RoPE factors
// (attention scaling included). Norms, RoPE, softmax, SiLU and the residual stream in float32;
// keys, values and the returned h rounded to bfloat16. Every token gets its own arithmetic
// (a slot's consecutive tokens share only exact conversions of the keys and values they read).
at::Tensor decoder_layer(const at::Tensor& h, const at::Tensor& input_norm,
                         const at::Tensor& post_norm, double eps, const QTuple& qkv,
                         const std::optional<at::Tensor>& qkv_bias, const QTuple& o_proj,
                         const std::optional<at::Tensor>& o_bias, const QTuple& gate_up,
                         const std::optional<at::Tensor>& gate_up_bias, const QTuple& down,
                         const std::optional<at::Tensor>& down_bias, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& page_table, const at::Tensor& slots,
                         const at::Tensor& positions, int64_t num_heads, int64_t num_kv_heads,
                         double scale) {
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.is_contiguous() && k_cache.dim() == 4 && k_cache.size(1) == num_kv_heads,
              "k_cache, v_cache must be contiguous bfloat16 [num_pages, Hkv, page_size, D]");
  const int64_t page_size = k_cache.size(2), D = k_cache.size(3);
  const LayerWeights w = check_layer(h, input_norm, post_norm, qkv, qkv_bias, o_proj, o_bias,
                                     gate_up, gate_up_bias, down, down_bias, cos, sin, num_heads,
                                     num_kv_heads, D);
  const int64_t T = w.T, Hq = w.Hq, Hkv = w.Hkv;
  check_pages(page_table, "decoder_layer");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  slots.is_contiguous() && positions.is_contiguous() && slots.numel() == T &&
                  positions.numel() == T, "slots [T], positions [T] must be contiguous int64");
  const int64_t* pt = page_table.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* ps = positions.data_ptr<int64_t>();
  const int64_t max_pages = page_table.size(1), num_pages = k_cache.size(0);
  // Every page a token reads (0..position of its slot) must exist.
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sl[t] >= 0 && sl[t] < page_table.size(0) && ps[t] >= 0 &&
                    ps[t] < max_pages * page_size, "token ", t, ": slot or position out of range");
    for (int64_t j = 0; j <= ps[t] / page_size; ++j) {
      const int64_t page = pt[sl[t] * max_pages + j];
      TORCH_CHECK(page >= 0 && page < num_pages, "token ", t, ": page ", page, " out of range");
    }
  }

  std::vector<float> resid, q, attn;
  layer_input(w, h, eps, resid, q);
  // RoPE on the query and key heads, then the keys and values into the cache.
  auto* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr());
  auto* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr());
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    float* row = &q[t * w.qkv.N];
    for (int64_t head = 0; head < Hq + Hkv; ++head)
      rope_head(row + head * D, cp + t * half, sp + t * half, half);
    const int64_t page = pt[sl[t] * max_pages + ps[t] / page_size];
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      const int64_t dst = ((page * Hkv + kvh) * page_size + ps[t] % page_size) * D;
      const float* kr = row + (Hq + kvh) * D;
      const float* vr = row + (Hq + Hkv + kvh) * D;
      for (int64_t i = 0; i < D; ++i) {
        kc[dst + i] = float_to_bf16(kr[i]);
        vc[dst + i] = float_to_bf16(vr[i]);
      }
    }
  }
  int64_t longest = 0;
  for (int64_t t = 0; t < T; ++t) longest = std::max(longest, ps[t] + 1);
  auto rows = [&](int64_t t, int64_t kvh) {
    const int64_t* pages = pt + sl[t] * max_pages;
    auto at = [=](const uint16_t* cache) {
      return [=](int64_t j) {
        return cache + ((pages[j / page_size] * Hkv + kvh) * page_size + j % page_size) * D;
      };
    };
    return std::make_pair(at(kc), at(vc));
  };
  attend_all(w, q, longest, scale, rows, [&](int64_t t) { return ps[t] + 1; },
             [&](int64_t t) { return sl[t]; }, attn);
  return layer_output(w, eps, resid, attn, h);
}

// One DFlash draft layer (Qwen3: q/k RMSNorm per head before RoPE) over R blocks of B slots
// (T = R * B flat tokens, block r = tokens r*B..r*B+B-1), the drafter's fast path when its
// projections are 8-bit (dspark_serve/drafter/backbone.py, same contract as DraftLayer):
// h [T, H] bfloat16 -> new h [T, H] bfloat16. Every block slot sees the first ctx_lens[r]
// context positions of slot slots[r] in the drafter's context cache ctx_k / ctx_v
// [num_pages, page_size, Hkv, D] bfloat16 (page_table[slot, position / page_size]; keys
// already normed and rotated) and, bidirectionally, the B keys of its own block. Nothing is
// written to the cache. q_norm, k_norm: [D] bfloat16; cos, sin: [T, D / 2] float32 at the
// slots' positions. Arithmetic as decoder_layer (float32 inside, block keys and values rounded
// to bfloat16 like the cache's, h returned in bfloat16).
at::Tensor draft_layer(const at::Tensor& h, const at::Tensor& input_norm,
                       const at::Tensor& post_norm, double eps, const QTuple& qkv,
                       const std::optional<at::Tensor>& qkv_bias, const QTuple& o_proj,
                       const std::optional<at::Tensor>& o_bias, const QTuple& gate_up,
                       const QTuple& down, const at::Tensor& q_norm, const at::Tensor& k_norm,
                       const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& ctx_k,
                       const at::Tensor& ctx_v, const at::Tensor& page_table,
                       const at::Tensor& slots, const at::Tensor& ctx_lens, int64_t num_heads,
                       int64_t num_kv_heads, double scale) {
  TORCH_CHECK(ctx_k.scalar_type() == at::kBFloat16 && ctx_k.is_contiguous() &&
                  ctx_v.sizes() == ctx_k.sizes() && ctx_v.scalar_type() == at::kBFloat16 &&
                  ctx_v.is_contiguous() && ctx_k.dim() == 4 && ctx_k.size(2) == num_kv_heads,
              "ctx_k, ctx_v must be contiguous bfloat16 [num_pages, page_size, Hkv, D]");
  const int64_t page_size = ctx_k.size(1), D = ctx_k.size(3);
  const LayerWeights w = check_layer(h, input_norm, post_norm, qkv, qkv_bias, o_proj, o_bias,
                                     gate_up, std::nullopt, down, std::nullopt, cos, sin,
                                     num_heads, num_kv_heads, D);
  const int64_t T = w.T, Hq = w.Hq, Hkv = w.Hkv, R = slots.numel();
  check_pages(page_table, "draft_layer");
  TORCH_CHECK(slots.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong &&
                  slots.is_contiguous() && ctx_lens.is_contiguous() && ctx_lens.numel() == R,
              "slots [R], ctx_lens [R] must be contiguous int64");
  TORCH_CHECK(R > 0 && T % R == 0, "h must hold R blocks of equal size (R = slots.numel())");
  TORCH_CHECK(q_norm.scalar_type() == at::kBFloat16 && k_norm.scalar_type() == at::kBFloat16 &&
                  q_norm.numel() == D && k_norm.numel() == D && q_norm.is_contiguous() &&
                  k_norm.is_contiguous(), "q_norm, k_norm must be contiguous bfloat16 [D]");
  const int64_t B = T / R, max_pages = page_table.size(1), num_pages = ctx_k.size(0);
  const int64_t* pt = page_table.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* cl = ctx_lens.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(sl[r] >= 0 && sl[r] < page_table.size(0) && cl[r] >= 0 &&
                    cl[r] <= max_pages * page_size, "block ", r, ": slot or context out of range");
    for (int64_t j = 0; j < (cl[r] + page_size - 1) / page_size; ++j) {
      const int64_t page = pt[sl[r] * max_pages + j];
      TORCH_CHECK(page >= 0 && page < num_pages, "block ", r, ": page ", page, " out of range");
    }
    longest = std::max(longest, cl[r] + B);
  }
  std::vector<float> resid, q, attn, normed(D);
  layer_input(w, h, eps, resid, q);
  // q/k norms and RoPE; the block's keys and values in bfloat16 [T, Hkv, D], as the cache's.
  std::vector<uint16_t> bk(T * Hkv * D), bv(T * Hkv * D);
  const auto* qn = reinterpret_cast<const uint16_t*>(q_norm.data_ptr());
  const auto* kn = reinterpret_cast<const uint16_t*>(k_norm.data_ptr());
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    float* row = &q[t * w.qkv.N];
    for (int64_t head = 0; head < Hq + Hkv; ++head) {
      float* v = row + head * D;
      rms_norm_row(v, head < Hq ? qn : kn, D, eps, normed.data());
      std::copy(normed.begin(), normed.end(), v);
      rope_head(v, cp + t * half, sp + t * half, half);
    }
    for (int64_t i = 0; i < Hkv * D; ++i) {
      bk[t * Hkv * D + i] = float_to_bf16(row[Hq * D + i]);
      bv[t * Hkv * D + i] = float_to_bf16(row[(Hq + Hkv) * D + i]);
    }
  }
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(ctx_k.data_ptr());
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(ctx_v.data_ptr());
  auto rows = [&](int64_t t, int64_t kvh) {
    const int64_t r = t / B, n_ctx = cl[r], first = r * B;
    const int64_t* pages = pt + sl[r] * max_pages;
    auto at = [=](const uint16_t* cache, const uint16_t* block) {
      return [=](int64_t j) {
        return j < n_ctx
                   ? cache + ((pages[j / page_size] * page_size + j % page_size) * Hkv + kvh) * D
                   : block + ((first + j - n_ctx) * Hkv + kvh) * D;
      };
    };
    return std::make_pair(at(kc, bk.data()), at(vc, bv.data()));
  };
  attend_all(w, q, longest, scale, rows, [&](int64_t t) { return cl[t / B] + B; },
             [&](int64_t t) { return t / B; }, attn);
  return layer_output(w, eps, resid, attn, h);
}

// The Markov head's left-to-right draw (paper Eq 4-5) for R blocks of G draft positions over
// a draft vocabulary of N tokens, one call instead of G rounds of small ops:
//   logits_k = U_k + W2 W1[x_{k-1}]   (x_0 = the anchor; W2 8-bit through qlinear, float32)
//   x_k = argmax logits_k              (rows with temperature < greedy_below: first maximum)
//   x_k ~ softmax(logits_k / T)        (other rows: inverse CDF at uniforms[r, k], the first
//                                       token whose cumulative mass exceeds u * total)
// base_logits [R, G, N] bfloat16 (U), w1 [V, r] bfloat16 (the embedding table over target
// ids), w2 (packed [N, r]), anchors [R] int64 target ids, draft_vocab [N] int64 target id of
// each draft index (None: N = V, the identity), temperature [R] and uniforms [R, G] float32.
// Returns tokens [R, G] int64 (target ids) and, when want_probs, probs [R, G, N] float32: the
// distribution each token was drawn from (a one-hot at the argmax for greedy rows); else an
// empty tensor. Filters (top-k, top-p, min-p) are the caller's (its PyTorch path).
std::tuple<at::Tensor, at::Tensor> markov_draw(
    const at::Tensor& base_logits, const at::Tensor& w1, const QTuple& w2,
    const at::Tensor& anchors, const std::optional<at::Tensor>& draft_vocab,
    const at::Tensor& temperature, const at::Tensor& uniforms, double greedy_below,
    bool want_probs) {
  TORCH_CHECK(cpu_supported(), "markov_draw needs AVX512-VNNI");
  const QWeight w = check_weight(w2, "w2");
  TORCH_CHECK(base_logits.device().is_cpu() && base_logits.scalar_type() == at::kBFloat16 &&
                  base_logits.dim() == 3 && base_logits.is_contiguous(),
              "base_logits must be contiguous bfloat16 [R, G, N] on the CPU");
  const int64_t R = base_logits.size(0), G = base_logits.size(1), N = base_logits.size(2);
  TORCH_CHECK(w.N == N, "w2 has ", w.N, " outputs, base_logits ", N);
  TORCH_CHECK(w1.scalar_type() == at::kBFloat16 && w1.is_contiguous() && w1.dim() == 2 &&
                  w1.size(1) == w.K, "w1 must be contiguous bfloat16 [V, ", w.K, "]");
  const int64_t V = w1.size(0), rank = w.K;
  TORCH_CHECK(anchors.scalar_type() == at::kLong && anchors.is_contiguous() &&
                  anchors.numel() == R, "anchors must be contiguous int64 [R]");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.is_contiguous() &&
                  temperature.numel() == R, "temperature must be contiguous float32 [R]");
  TORCH_CHECK(uniforms.scalar_type() == at::kFloat && uniforms.is_contiguous() &&
                  uniforms.sizes() == at::IntArrayRef({R, G}),
              "uniforms must be contiguous float32 [R, G]");
  const int64_t* ids = nullptr;
  if (draft_vocab) {
    TORCH_CHECK(draft_vocab->scalar_type() == at::kLong && draft_vocab->is_contiguous() &&
                    draft_vocab->numel() == N, "draft_vocab must be contiguous int64 [N]");
    ids = draft_vocab->data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK(ids[i] >= 0 && ids[i] < V, "draft_vocab id ", ids[i], " out of range");
  } else {
    TORCH_CHECK(N == V, "without draft_vocab the draft vocabulary is all ", V, " tokens");
  }
  const auto* u = reinterpret_cast<const uint16_t*>(base_logits.data_ptr());
  const auto* table = reinterpret_cast<const uint16_t*>(w1.data_ptr());
  const float* temp = temperature.data_ptr<float>();
  const float* unif = uniforms.data_ptr<float>();
  at::Tensor tokens = at::empty({R, G}, anchors.options());
  at::Tensor probs = at::empty({want_probs ? R : 0, G, N}, temperature.options());
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* pr = want_probs ? probs.data_ptr<float>() : nullptr;
  std::vector<int64_t> prev(anchors.data_ptr<int64_t>(), anchors.data_ptr<int64_t>() + R);
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(prev[r] >= 0 && prev[r] < V, "anchor ", prev[r], " out of range");
  std::vector<float> emb(R * rank), logits(R * N);
  for (int64_t k = 0; k < G; ++k) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < rank; ++i) emb[r * rank + i] = bf16_to_float(table[prev[r] * rank + i]);
    qlinear(emb.data(), R, w, nullptr, logits.data());
    for (int64_t r = 0; r < R; ++r) {
      float* lg = &logits[r * N];
      const uint16_t* base = u + (r * G + k) * N;
      for (int64_t i = 0; i < N; ++i) lg[i] += bf16_to_float(base[i]);
      float* p = pr == nullptr ? nullptr : pr + (r * G + k) * N;
      int64_t best = 0;
      if (temp[r] < greedy_below) {
        for (int64_t i = 1; i < N; ++i)
          if (lg[i] > lg[best]) best = i;
        if (p != nullptr) {
          std::fill(p, p + N, 0.0f);
          p[best] = 1.0f;
        }
      } else {
        TORCH_CHECK(p != nullptr, "sampled rows need want_probs");
        const float inv_t = 1.0f / temp[r];
        float top = -INFINITY;
        for (int64_t i = 0; i < N; ++i) top = std::max(top, lg[i] * inv_t);
        double total = 0.0;
        for (int64_t i = 0; i < N; ++i) total += (p[i] = std::exp(lg[i] * inv_t - top));
        const float norm = static_cast<float>(1.0 / total);
        for (int64_t i = 0; i < N; ++i) p[i] *= norm;
        // inverse CDF; never past the last token with mass (float rounding of the sum)
        const double target = static_cast<double>(unif[r * G + k]);
        double cdf = 0.0;
        best = -1;
        for (int64_t i = 0; i < N; ++i) {
          if (p[i] <= 0.0f) continue;
          best = i;
          cdf += p[i];
          if (cdf > target) break;
        }
        TORCH_CHECK(best >= 0, "a row without probability mass");
      }
      prev[r] = ids == nullptr ? best : ids[best];
      tok[r * G + k] = prev[r];
    }
  }
  return {tokens, probs};
}

// The drafter's context of N committed tokens (paper Eq 2-3), the compiled twin of
// DFlashBackbone.context_state + context_kv: h_ctx = rms_norm(fc(taps)) [N, H], then per draft
// layer l its keys k_norm(k_proj(h_ctx)) rotated by RoPE and values v_proj(h_ctx). taps [N, C]
// bfloat16; fc packed [H, C]; hidden_norm [H] bfloat16; kv[l] packed [2 Hkv D, H] (k_proj rows,
// then v_proj rows); k_norms[l] [D] bfloat16; cos, sin [N, D / 2] float32. Returns h_ctx
// [N, H], k, v [L, N, Hkv, D], all bfloat16 (the projections read h_ctx as rounded).
std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_context(
    const at::Tensor& taps, const QTuple& fc, const at::Tensor& hidden_norm,
    const std::vector<QTuple>& kv, const std::vector<at::Tensor>& k_norms, const at::Tensor& cos,
    const at::Tensor& sin, double eps, int64_t num_kv_heads) {
  TORCH_CHECK(cpu_supported(), "draft_context needs AVX512-VNNI");
  const QWeight wfc = check_weight(fc, "fc");
  TORCH_CHECK(taps.device().is_cpu() && taps.scalar_type() == at::kBFloat16 && taps.dim() == 2 &&
                  taps.is_contiguous() && taps.size(1) == wfc.K,
              "taps must be contiguous bfloat16 [N, ", wfc.K, "]");
  const int64_t N = taps.size(0), H = wfc.N, L = kv.size(), Hkv = num_kv_heads;
  TORCH_CHECK(L > 0 && k_norms.size() == kv.size(), "one kv weight and k_norm per layer");
  TORCH_CHECK(hidden_norm.scalar_type() == at::kBFloat16 && hidden_norm.numel() == H &&
                  hidden_norm.is_contiguous() && H % 16 == 0,
              "hidden_norm must be contiguous bfloat16 [H], H a multiple of 16");
  const int64_t D = k_norms[0].numel();
  TORCH_CHECK(Hkv > 0 && (D == 64 || D == 128), "head_dim must be 64 or 128");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() &&
                  cos.sizes() == at::IntArrayRef({N, D / 2}) && sin.sizes() == cos.sizes(),
              "cos, sin must be contiguous float32 [N, D / 2]");
  std::vector<QWeight> wkv;
  for (int64_t l = 0; l < L; ++l) {
    wkv.push_back(check_weight(kv[l], "kv"));
    TORCH_CHECK(wkv[l].K == H && wkv[l].N == 2 * Hkv * D, "kv[", l, "] must be [2 Hkv D, H]");
    TORCH_CHECK(k_norms[l].scalar_type() == at::kBFloat16 && k_norms[l].numel() == D &&
                    k_norms[l].is_contiguous(), "k_norms[", l, "] must be contiguous bfloat16 [D]");
  }
  const auto* tp = reinterpret_cast<const uint16_t*>(taps.data_ptr());
  std::vector<float> x(N * wfc.K), y(N * H), h(N * H), out(N * 2 * Hkv * D), normed(D);
  for (int64_t i = 0; i < N * wfc.K; ++i) x[i] = bf16_to_float(tp[i]);
  at::Tensor h_ctx = at::empty({N, H}, taps.options());
  at::Tensor k = at::empty({L, N, Hkv, D}, taps.options()), v = at::empty_like(k);
  auto* hp = reinterpret_cast<uint16_t*>(h_ctx.data_ptr());
  auto* kp = reinterpret_cast<uint16_t*>(k.data_ptr());
  auto* vp = reinterpret_cast<uint16_t*>(v.data_ptr());
  if (N == 0) return {h_ctx, k, v};
  qlinear(x.data(), N, wfc, nullptr, y.data());
  const auto* hn = reinterpret_cast<const uint16_t*>(hidden_norm.data_ptr());
  for (int64_t t = 0; t < N; ++t) {
    rms_norm_row(&y[t * H], hn, H, eps, &h[t * H]);
    for (int64_t i = 0; i < H; ++i) {
      hp[t * H + i] = float_to_bf16(h[t * H + i]);
      h[t * H + i] = bf16_to_float(hp[t * H + i]);
    }
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t half = D / 2, row = Hkv * D;
  for (int64_t l = 0; l < L; ++l) {
    qlinear(h.data(), N, wkv[l], nullptr, out.data());
    const auto* kn = reinterpret_cast<const uint16_t*>(k_norms[l].data_ptr());
    for (int64_t t = 0; t < N; ++t) {
      float* o = &out[t * 2 * row];
      for (int64_t head = 0; head < Hkv; ++head) {
        rms_norm_row(o + head * D, kn, D, eps, normed.data());
        std::copy(normed.begin(), normed.end(), o + head * D);
        rope_head(o + head * D, cp + t * half, sp + t * half, half);
      }
      for (int64_t i = 0; i < row; ++i) {
        kp[(l * N + t) * row + i] = float_to_bf16(o[i]);
        vp[(l * N + t) * row + i] = float_to_bf16(o[row + i]);
      }
    }
  }
  return {h_ctx, k, v};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &cpu_supported, "whether this CPU has the instructions the kernels need");
  m.def("quantized_linear", &quantized_linear,
        "y = x @ W^T, W in 4- or 8-bit groups of 32, x quantized to int8 per group of 32");
  m.def("decoder_layer", &decoder_layer, "one decoder layer with quantized projections");
  m.def("draft_layer", &draft_layer, "one DFlash draft layer with quantized projections");
  m.def("draft_context", &draft_context, "the drafter's context states, keys and values");
  m.def("markov_draw", &markov_draw, "the Markov head's left-to-right draw of a draft block");
}
