// Decode attention over a paged KV cache of float32 or float16 elements, shared by
// paged_decode.cpp and decode_step.cpp (see paged_decode.cpp for the method). Queries,
// scores and sums are float32 whatever the cache holds. Header-only, in namespace tyk.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "simd.h"

namespace tyk {

// A float16 cache element, as its IEEE binary16 bits.
using half_t = uint16_t;

// binary16 <-> float32 without F16C (the scalar tails of builds without AVX2): exact for
// every half, round to nearest even the other way, overflow to infinity.
inline float half_to_float(half_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline half_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<half_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
  if (ax >= 0x477ff000u) return static_cast<half_t>(sign | 0x7c00u);  // rounds past 65504
  if (ax < 0x38800000u) {  // below the smallest normal half: a subnormal or zero
    if (ax < 0x33000000u) return static_cast<half_t>(sign);
    const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t v = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (v & 1u))) ++v;
    return static_cast<half_t>(sign | v);
  }
  uint32_t v = ((ax >> 13) - (112u << 10));
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (v & 1u))) ++v;
  return static_cast<half_t>(sign | v);
}

inline float load1(const float* p) { return *p; }
inline float load1(const half_t* p) { return half_to_float(*p); }

// dst[:n] = src[:n] as the cache's element type.
inline void store_row(float* dst, const float* src, int64_t n) { std::copy_n(src, n, dst); }
inline void store_row(half_t* dst, const float* src, int64_t n) {
  int64_t d = 0;
#if TY_AVX2
  for (; d + 8 <= n; d += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; d < n; ++d) dst[d] = float_to_half(src[d]);
}

#if TY_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const half_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// exp(x) for x <= 0 (scores minus their max): x = n*ln2 + r, |r| <= ln2/2, degree-6
// polynomial for exp(r), 2^n through the exponent bits. Relative error ~1e-7.
inline __m256 exp256(__m256 x) {
  const __m256 lo_clamp = _mm256_set1_ps(-87.3f);
  x = _mm256_max_ps(x, lo_clamp);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f);
  const __m256 ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  int64_t d = 0;
  float s = 0.f;
#if TY_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; d + 16 <= n; d += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b + d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), load8(b + d + 8), acc1);
  }
  for (; d + 8 <= n; d += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b + d), acc0);
  }
  s = hsum256(_mm256_add_ps(acc0, acc1));
#endif
  for (; d < n; ++d) s += a[d] * load1(b + d);
  return s;
}

// acc[:n] += w * v[:n]
template <typename T>
inline void axpy(float* acc, float w, const T* v, int64_t n) {
  int64_t d = 0;
#if TY_AVX2
  const __m256 wv = _mm256_set1_ps(w);
  for (; d + 8 <= n; d += 8) {
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, load8(v + d), _mm256_loadu_ps(acc + d)));
  }
#endif
  for (; d < n; ++d) acc[d] += w * load1(v + d);
}

// max(p[:n]) (-inf when n = 0), eight lanes at a time.
inline float max_of(const float* p, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if TY_AVX2
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(p);
    for (t = 8; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  }
#endif
  for (; t < n; ++t) m = std::max(m, p[t]);
  return m;
}

// p[:n] = exp(p[:n] - m); returns the sum.
inline float exp_sub_sum(float* p, float m, int64_t n) {
  int64_t t = 0;
  float sum = 0.f;
#if TY_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + t), mv));
    _mm256_storeu_ps(p + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum256(acc);
#endif
  for (; t < n; ++t) {
    p[t] = std::exp(p[t] - m);
    sum += p[t];
  }
  return sum;
}


#if TY_AVX2
// Asks for the cache lines of a row of n elements (into L2 and up).
template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// Sums of each of 8 vectors, as one vector: out[j] = sum(a[j]).
inline __m256 reduce8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 t0 = _mm256_hadd_ps(s01, s23);
  const __m256 t1 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// scores[t..t+8) = q . rows[t..t+8), D a multiple of 8.
template <typename T>
inline void dot8(const float* q, const T* const* rows, int64_t D, float* scores) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(rows[j] + d), acc[j]);
  }
  _mm256_storeu_ps(scores, reduce8(acc));
}

// out[g][c*32 .. +32) = sum_t p[g][t] * rows[t][c*32 .. +32) for NG queries, accumulators
// held in registers (NG * 4 of them).
template <int NG, typename T>
inline void weighted_sum32(const float* const* p, int64_t ctx, const T* const* rows,
                           int64_t off, const float* inv, float* const* out) {
  __m256 acc[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int u = 0; u < 4; ++u) acc[g][u] = _mm256_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t) {
    const T* r = rows[t] + off;
    const __m256 v0 = load8(r), v1 = load8(r + 8);
    const __m256 v2 = load8(r + 16), v3 = load8(r + 24);
    for (int g = 0; g < NG; ++g) {
      const __m256 w = _mm256_broadcast_ss(p[g] + t);
      acc[g][0] = _mm256_fmadd_ps(w, v0, acc[g][0]);
      acc[g][1] = _mm256_fmadd_ps(w, v1, acc[g][1]);
      acc[g][2] = _mm256_fmadd_ps(w, v2, acc[g][2]);
      acc[g][3] = _mm256_fmadd_ps(w, v3, acc[g][3]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m256 s = _mm256_set1_ps(inv[g]);
    for (int u = 0; u < 4; ++u) _mm256_storeu_ps(out[g] + off + 8 * u, _mm256_mul_ps(acc[g][u], s));
  }
}
#endif

// An uninitialised buffer of n elements (std::vector would zero it).
template <typename T>
struct Scratch {
  std::unique_ptr<T[]> p;
  explicit Scratch(size_t n) : p(new T[n]) {}
  T* data() { return p.get(); }
  T& operator[](size_t i) { return p[i]; }
};

// Work items [begin, end) of N * KVH (decode row, kv head): out[i, h] for the heads of the
// item's query group. q [N, H, D] and out [N, H, D] contiguous; caches
// [num_blocks, BS, KVH, D]; tables [N, max_blocks]; lens [N]; max_ctx = max(lens).
// `tail` > 1 folds that many consecutive query positions into each row (a prefill's tail
// over a cached prefix): row i's heads are [KVH][tail][G1], G1 = H / KVH / tail, position
// r of the tail ending at lens[i] sees lens[i] - (tail - 1 - r) keys, so each K/V row is
// read once for all of them.
template <typename T>
inline void attend_items(int64_t begin, int64_t end, const float* qp, const T* kp,
                         const T* vp, const int64_t* tables, const int64_t* lens,
                         int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t max_blocks,
                         int64_t max_ctx, float fscale, float* op, int64_t tail = 1) {
  const int64_t G = H / KVH;
  const int64_t G1 = G / tail;  // the model's query group; G = tail * G1 (see below)
  const int64_t tok_stride = KVH * D;     // between tokens of a block
  const int64_t blk_stride = BS * KVH * D;  // between blocks
  // Written before read (scores up to each item's context), so left uninitialised:
  // zeroing G * max_ctx floats per call cost a tail's step ~1 % in memset.
  Scratch<float> scores(static_cast<size_t>(G * max_ctx));
  std::vector<float> acc(static_cast<size_t>(G * D));
  std::vector<float> qs(static_cast<size_t>(G * D));
  std::vector<float> inv(static_cast<size_t>(G));
  Scratch<const T*> krows(static_cast<size_t>(max_ctx));
  Scratch<const T*> vrows(static_cast<size_t>(max_ctx));
  std::vector<const float*> prow(static_cast<size_t>(G));
  std::vector<float*> orow(static_cast<size_t>(G));
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item / KVH, kvh = item % KVH;
    const int64_t ctx = lens[i];
    const int64_t* table = tables + i * max_blocks;
    for (int64_t t = 0; t < ctx; ++t) {
      const int64_t off = table[t / BS] * blk_stride + (t % BS) * tok_stride + kvh * D;
      krows[t] = kp + off;
      vrows[t] = vp + off;
    }
    // Query group of this kv head, pre-scaled.
    for (int64_t g = 0; g < G; ++g) {
      const float* src = qp + (i * H + kvh * G + g) * D;
      for (int64_t d = 0; d < D; ++d) qs[g * D + d] = src[d] * fscale;
      prow[g] = scores.data() + g * max_ctx;
      orow[g] = op + (i * H + kvh * G + g) * D;
    }
    // Pass 1: scores [G, ctx], eight keys at a time while they sit in L1.
    int64_t t = 0;
#if TY_AVX2
    if (D % 8 == 0) {
      for (; t + 8 <= ctx; t += 8) {
        // The rows 16 keys on (K now, V for pass 3) start coming in while these compute:
        // a cached context is read from memory once, in the first of its passes.
        if (t + 24 <= ctx) {
          for (int64_t j = 16; j < 24; ++j) {
            prefetch_row(krows[t + j], D);
            prefetch_row(vrows[t + j], D);
          }
        }
        for (int64_t g = 0; g < G; ++g) dot8(qs.data() + g * D, krows.data() + t, D, scores.data() + g * max_ctx + t);
      }
    }
#endif
    for (; t < ctx; ++t)
      for (int64_t g = 0; g < G; ++g) scores[g * max_ctx + t] = dot(qs.data() + g * D, krows[t], D);
    // Pass 2: softmax weights per query (unnormalised; 1/sum applied at the end).
    // With `tail` > 1 the group holds the query groups of `tail` consecutive positions
    // (query g is position r = g / G1 of them): position r sees ctx - (tail - 1 - r) keys,
    // the weights of the keys past it are zero.
    for (int64_t g = 0; g < G; ++g) {
      float* s = scores.data() + g * max_ctx;
      const int64_t seen = ctx - (tail - 1 - g / G1);
      inv[g] = 1.0f / exp_sub_sum(s, max_of(s, seen), seen);
      std::fill(s + seen, s + ctx, 0.f);
    }
    // Pass 3: weighted sum of V.
#if TY_AVX2
    if (D % 32 == 0) {
      for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int64_t ng = std::min<int64_t>(3, G - g0);
        for (int64_t off = 0; off < D; off += 32) {
          if (ng == 3)
            weighted_sum32<3>(prow.data() + g0, ctx, vrows.data(), off, inv.data() + g0, orow.data() + g0);
          else if (ng == 2)
            weighted_sum32<2>(prow.data() + g0, ctx, vrows.data(), off, inv.data() + g0, orow.data() + g0);
          else
            weighted_sum32<1>(prow.data() + g0, ctx, vrows.data(), off, inv.data() + g0, orow.data() + g0);
        }
      }
      continue;
    }
#endif
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t u = 0; u < ctx; ++u)
      for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * D, scores[g * max_ctx + u], vrows[u], D);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) orow[g][d] = acc[g * D + d] * inv[g];
  }
}

}  // namespace tyk
