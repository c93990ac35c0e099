// What the CPU kernels share: whether the AVX2 paths are compiled in, and a lane sum.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TY_AVX2 1
#else
#define TY_AVX2 0
#endif

// VNNI: u8 x s8 products summed four to an int32 lane and added to it in one instruction
// (what maddubs then madd with ones computes, without the int16 step), and int16 pairs
// likewise (madd then add). AVX-VNNI or AVX-512 VNNI on 256-bit registers, where the
// compiler targets a CPU that has either.
#if TY_AVX2 && defined(__AVXVNNI__)
#define TY_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define TY_DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#elif TY_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TY_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define TY_DPWSSD(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#endif

namespace tyk {

#if TY_AVX2
inline float hsum256(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  lo = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, lo);
  return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}
#endif

}  // namespace tyk
