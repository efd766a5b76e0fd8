// The AVX-512 operations kernels.inc uses, for CPUs with AVX2, FMA and F16C only (AMD Zen 1-3,
// Intel before Ice Lake, most desktop CPUs): a 512-bit vector is two 256-bit halves and every
// operation is lane for lane the AVX-512 one, so the kernels run unchanged and each output keeps
// its own fixed arithmetic (row invariance). Included inside kernels.inc's namespace, where these
// names hide immintrin.h's; group_dot replaces vpdpbusd (AVX512-VNNI).
#define DSPARK_SIMD __attribute__((target("avx2,fma,f16c")))

constexpr const char* kIsa = "AVX2, FMA and F16C";

inline bool isa_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
#define DSPARK_EMULATED DSPARK_SIMD __attribute__((always_inline)) inline

struct __m512 { __m256 lo, hi; };
struct __m512i { __m256i lo, hi; };

DSPARK_EMULATED __m512 _mm512_setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
DSPARK_EMULATED __m512 _mm512_set1_ps(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
DSPARK_EMULATED __m512 _mm512_loadu_ps(const float* p) {
  return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
DSPARK_EMULATED void _mm512_storeu_ps(float* p, __m512 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}

#define DSPARK_BINARY(name, op)                                        \
  DSPARK_EMULATED __m512 name(__m512 a, __m512 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
DSPARK_BINARY(_mm512_add_ps, _mm256_add_ps)
DSPARK_BINARY(_mm512_sub_ps, _mm256_sub_ps)
DSPARK_BINARY(_mm512_mul_ps, _mm256_mul_ps)
DSPARK_BINARY(_mm512_div_ps, _mm256_div_ps)
DSPARK_BINARY(_mm512_max_ps, _mm256_max_ps)
DSPARK_BINARY(_mm512_min_ps, _mm256_min_ps)
DSPARK_BINARY(_mm512_unpacklo_ps, _mm256_unpacklo_ps)
DSPARK_BINARY(_mm512_unpackhi_ps, _mm256_unpackhi_ps)
#undef DSPARK_BINARY

DSPARK_EMULATED __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
DSPARK_EMULATED __m512 _mm512_fnmadd_ps(__m512 a, __m512 b, __m512 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
DSPARK_EMULATED __m512 _mm512_abs_ps(__m512 a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}
DSPARK_EMULATED __m512 _mm512_roundscale_ps(__m512 a, const int imm) {
  return {_mm256_round_ps(a.lo, imm), _mm256_round_ps(a.hi, imm)};
}
DSPARK_EMULATED __m512 _mm512_shuffle_ps(__m512 a, __m512 b, const int imm) {
  return {_mm256_shuffle_ps(a.lo, b.lo, imm), _mm256_shuffle_ps(a.hi, b.hi, imm)};
}

// 128-bit lane i (0..3) of a.
DSPARK_EMULATED __m128 lane128(__m512 a, int i) {
  const __m256 half = i < 2 ? a.lo : a.hi;
  return (i & 1) ? _mm256_extractf128_ps(half, 1) : _mm256_castps256_ps128(half);
}
// Lanes (a[imm 1:0], a[imm 3:2], b[imm 5:4], b[imm 7:6]), as vshuff32x4.
DSPARK_EMULATED __m512 _mm512_shuffle_f32x4(__m512 a, __m512 b, const int imm) {
  return {_mm256_set_m128(lane128(a, (imm >> 2) & 3), lane128(a, imm & 3)),
          _mm256_set_m128(lane128(b, (imm >> 6) & 3), lane128(b, (imm >> 4) & 3))};
}

// a * 2^n for integral n in [-150, 127] (exp_ps's range), rounded once as vscalefps: the first
// factor keeps a * 2^max(n, -100) normal (exact for exp_ps's |a| < 2), the second rounds.
DSPARK_EMULATED __m256 pow2(__m256 e) {   // 2^e, e integral in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23));
}
DSPARK_EMULATED __m256 scalef256(__m256 a, __m256 n) {
  const __m256 first = _mm256_max_ps(n, _mm256_set1_ps(-100.0f));
  return _mm256_mul_ps(_mm256_mul_ps(a, pow2(first)), pow2(_mm256_sub_ps(n, first)));
}
DSPARK_EMULATED __m512 _mm512_scalef_ps(__m512 a, __m512 n) {
  return {scalef256(a.lo, n.lo), scalef256(a.hi, n.hi)};
}

DSPARK_EMULATED float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
DSPARK_EMULATED float _mm512_reduce_max_ps(__m512 a) { return hmax256(_mm256_max_ps(a.lo, a.hi)); }
// A fixed tree (halves, then 128-bit lanes, then pairs), so a sum depends on its lanes only.
DSPARK_EMULATED float _mm512_reduce_add_ps(__m512 a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Masks: bit i of k selects float lane i (lo lanes 0-7, hi lanes 8-15).
DSPARK_EMULATED __m256i mask256(unsigned bits) {
  const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits), select), select);
}
DSPARK_EMULATED void _mm512_mask_storeu_ps(float* p, __mmask16 k, __m512 a) {
  _mm256_maskstore_ps(p, mask256(k & 0xFF), a.lo);
  _mm256_maskstore_ps(p + 8, mask256(k >> 8), a.hi);
}
DSPARK_EMULATED __m512 _mm512_maskz_loadu_ps(__mmask16 k, const float* p) {   // no fault past k
  return {_mm256_maskload_ps(p, mask256(k & 0xFF)), _mm256_maskload_ps(p + 8, mask256(k >> 8))};
}
DSPARK_EMULATED __m512 _mm512_maskz_mov_ps(__mmask16 k, __m512 a) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(mask256(k & 0xFF))),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(mask256(k >> 8)))};
}
DSPARK_EMULATED __m512 _mm512_mask_max_ps(__m512 src, __mmask16 k, __m512 a, __m512 b) {
  const __m256 lo = _mm256_castsi256_ps(mask256(k & 0xFF));
  const __m256 hi = _mm256_castsi256_ps(mask256(k >> 8));
  return {_mm256_blendv_ps(src.lo, _mm256_max_ps(a.lo, b.lo), lo),
          _mm256_blendv_ps(src.hi, _mm256_max_ps(a.hi, b.hi), hi)};
}

DSPARK_EMULATED __m512i _mm512_set1_epi32(int a) {
  return {_mm256_set1_epi32(a), _mm256_set1_epi32(a)};
}
DSPARK_EMULATED __m512i _mm512_set1_epi8(char a) {
  return {_mm256_set1_epi8(a), _mm256_set1_epi8(a)};
}
DSPARK_EMULATED __m512i _mm512_loadu_si512(const void* p) {
  const auto* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
DSPARK_EMULATED __m512i _mm512_add_epi32(__m512i a, __m512i b) {
  return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
DSPARK_EMULATED __m512i _mm512_sub_epi32(__m512i a, __m512i b) {
  return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)};
}
DSPARK_EMULATED __m512i _mm512_and_si512(__m512i a, __m512i b) {
  return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)};
}
DSPARK_EMULATED __m512i _mm512_srli_epi16(__m512i a, unsigned n) {
  return {_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)};
}
DSPARK_EMULATED __m512i _mm512_slli_epi32(__m512i a, unsigned n) {
  return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)};
}
DSPARK_EMULATED int _mm512_reduce_add_epi32(__m512i a) {
  const __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1))));
}

DSPARK_EMULATED __m512i _mm512_cvtps_epi32(__m512 a) {
  return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)};
}
DSPARK_EMULATED __m512 _mm512_cvtepi32_ps(__m512i a) {
  return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)};
}
DSPARK_EMULATED __m512 _mm512_castsi512_ps(__m512i a) {
  return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)};
}
DSPARK_EMULATED __m512 _mm512_cvtph_ps(__m256i a) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(a)),
          _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1))};
}
DSPARK_EMULATED __m512i _mm512_cvtepu16_epi32(__m256i a) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)),
          _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}
// 16 int32 -> 16 int8 with signed saturation, in lane order.
DSPARK_EMULATED __m128i _mm512_cvtsepi32_epi8(__m512i a) {
  const __m256i words =
      _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), _MM_SHUFFLE(3, 1, 2, 0));
  return _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}

// group_dot as avx512_native.h's, per 256-bit half: 16-bit multiply-adds (vpmaddubsw) of the
// unsigned 4-bit weights by the broadcast activations: a 16-bit lane sums two products of
// |x| <= 127 per quad, 16 over the group (|sum| <= 30,480: exact), then one vpmaddwd widens
// them. 8-bit weights go as their two nibbles likewise, the high nibbles' sums times 16.
template <int Bits>
DSPARK_EMULATED __m256i group_dot256(const __m256i* w, const int8_t* xq) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i sum16 = _mm256_setzero_si256(), high16 = _mm256_setzero_si256();
  for (int t = 0; t < 8; ++t) {
    int32_t v;
    std::memcpy(&v, xq + 4 * t, 4);
    const __m256i x = _mm256_set1_epi32(v);
    const __m256i wt = w[2 * t];   // w: the halves of 8 __m512i, lo and hi in turn
    if constexpr (Bits == 4) {
      sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(wt, x));
    } else {
      sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(_mm256_and_si256(wt, low4), x));
      high16 = _mm256_add_epi16(high16, _mm256_maddubs_epi16(
                                            _mm256_and_si256(_mm256_srli_epi16(wt, 4), low4), x));
    }
  }
  const __m256i sum = _mm256_madd_epi16(sum16, _mm256_set1_epi16(1));
  if constexpr (Bits == 4) return sum;
  return _mm256_add_epi32(sum, _mm256_madd_epi16(high16, _mm256_set1_epi16(16)));
}
template <int Bits>
DSPARK_EMULATED __m512i group_dot(const __m512i* w, const int8_t* xq) {
  const auto* halves = reinterpret_cast<const __m256i*>(w);
  return {group_dot256<Bits>(halves, xq), group_dot256<Bits>(halves + 1, xq)};
}

#undef DSPARK_EMULATED
