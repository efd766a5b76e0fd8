// The prelude of kernels.inc for AVX512-VNNI CPUs: the intrinsics themselves.
#define DSPARK_SIMD __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

constexpr const char* kIsa = "AVX512-VNNI";

inline bool isa_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// [16] int32: lane j = the sum over a group's 32 weights of channel j's unsigned bytes (w[t]:
// quad t, 16 lanes x 4 bytes) times the row's signed activations xq [32], by vpdpbusd.
template <int Bits>
DSPARK_SIMD inline __m512i group_dot(const __m512i* w, const int8_t* xq) {
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
  return _mm512_add_epi32(even, odd);
}
