// The block matmul core shared by quant_matmul.cpp and decode_step.cpp: activation
// quantization per block of 32, integer block dot products and the row loop (see
// quant_matmul.cpp for the formats). Header-only, in namespace tyk.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "simd.h"

namespace tyk {


constexpr int64_t QK = 32;
constexpr int64_t Q8_0 = 0;
constexpr int64_t Q4_1 = 1;
constexpr int64_t ROW_TILE = 64;  // weight rows kept hot while the activation rows pass

inline int64_t block_bytes(int64_t qtype) { return qtype == Q8_0 ? 34 : 20; }

inline float fp16_to_fp32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if TY_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float f = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                                  : (sign | ((exp + 112u) << 23) | (mant << 13));
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

// One activation row -> q[K] (int8: d = max|x| / 127, or int16: d = max|x| / 32767),
// d[nb] and s[nb] = d * sum(q) per block. int16 gives ~2^-16 relative precision per
// block, which keeps the blocks holding SmolLM2's outlier channels accurate (int8 costs
// ~4 % of greedy top-1 agreement with float32 there; int16 ~0.05 %).
template <typename T>
void quantize_row(const float* x, int64_t K, T* q, float* d, float* s) {
  constexpr float LEVELS = sizeof(T) == 1 ? 127.f : 32767.f;
  const int64_t nb = K / QK;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    T* qb = q + b * QK;
#if TY_AVX2
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
    __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign_mask, v0), _mm256_andnot_ps(sign_mask, v1)),
                              _mm256_max_ps(_mm256_andnot_ps(sign_mask, v2), _mm256_andnot_ps(sign_mask, v3)));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float dd = amax / LEVELS;
    const __m256 id = _mm256_set1_ps(amax > 0.f ? LEVELS / amax : 0.f);
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, id), rnd));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, id), rnd));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, id), rnd));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, id), rnd));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    // packs interleave the 128-bit lanes; the permutes restore element order.
    const __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
    if constexpr (sizeof(T) == 1) {
      __m256i p = _mm256_packs_epi16(p01, p23);
      p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), p);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_permute4x64_epi64(p01, 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16), _mm256_permute4x64_epi64(p23, 0xD8));
    }
    d[b] = dd;
    s[b] = dd * static_cast<float>(_mm_cvtsi128_si32(s4));
#else
    float amax = 0.f;
    for (int64_t j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float dd = amax / LEVELS;
    const float id = amax > 0.f ? LEVELS / amax : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < QK; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * id));
      qb[j] = static_cast<T>(v);
      sum += v;
    }
    d[b] = dd;
    s[b] = dd * static_cast<float>(sum);
#endif
  }
}

#if TY_AVX2
// The 32 weights of a block as unsigned (Q4_1: 0..15) or signed (Q8_0) bytes.
inline __m256i q8_0_values(const uint8_t* blk) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
}
inline __m256i q4_1_values(const uint8_t* blk) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
}

// sum over the block of w * x as 8 int32 lanes. int8 x: maddubs (u8 x s8 pairs; Q8_0 via
// the sign trick, |w| x sign(w) * x), then madd with ones. int16 x: widen w to int16 and
// madd twice (products <= 127 * 32767, four to a lane: no overflow).
inline __m256i block_dot(__m256i w, bool w_signed, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i u = w_signed ? _mm256_sign_epi8(w, w) : w;
  const __m256i v = w_signed ? _mm256_sign_epi8(xv, w) : xv;
#ifdef TY_DPBUSD
  // The same sums: maddubs never saturates here (|w| <= 128, |x| <= 127, pairs < 2^15).
  return TY_DPBUSD(_mm256_setzero_si256(), u, v);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}
// A block's 32 weights widened to int16 for int16 activations: weights 0..15 and 16..31.
struct Wide {
  __m256i lo, hi;
};
inline __m256i block_dot(const Wide& w, bool, const int16_t* x) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
#ifdef TY_DPWSSD
  return TY_DPWSSD(TY_DPWSSD(_mm256_setzero_si256(), w.lo, x0), w.hi, x1);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w.lo, x0), _mm256_madd_epi16(w.hi, x1));
#endif
}

// A block's weights as the row loop's block_dot takes them for activations of type T:
// bytes for int8; for int16 widened, Q4_1's 16 bytes widened once, their low nibbles
// then weights 0..15 and their high ones 16..31 (3 instructions where unpacking to bytes
// and widening each half took 7; one-row decode is bound by instructions per block).
template <int64_t QT, typename T>
inline auto block_weights(const uint8_t* blk) {
  if constexpr (sizeof(T) == 1) {
    return QT == Q8_0 ? q8_0_values(blk) : q4_1_values(blk);
  } else if constexpr (QT == Q8_0) {
    const auto* q = reinterpret_cast<const __m128i*>(blk + 2);
    return Wide{_mm256_cvtepi8_epi16(_mm_loadu_si128(q)), _mm256_cvtepi8_epi16(_mm_loadu_si128(q + 1))};
  } else {
    const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
    return Wide{_mm256_and_si256(wide, _mm256_set1_epi16(0x0f)), _mm256_srli_epi16(wide, 4)};
  }
}

// A Q4_1 block's scale d (lane 0) and minimum m (lane 1): its first four bytes, two fp16
// converted in one instruction.
inline __m128 q4_1_dm(const uint8_t* blk) {
  uint32_t dm;
  std::memcpy(&dm, blk, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
}
#endif

// out[r] = dot(weight row w, activation row r) for R activation rows (int8 or int16 q).
template <int R, int64_t QT, typename T>
inline void dot_rows(const uint8_t* w, int64_t nb, const T* const* xq, const float* const* xd,
                     const float* const* xs, float* out) {
  constexpr int64_t BB = QT == Q8_0 ? 34 : 20;
  float mins[R];
  for (int r = 0; r < R; ++r) mins[r] = 0.f;
#if TY_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BB;
    const __m128 dm = QT == Q4_1 ? q4_1_dm(blk) : _mm_set_ss(fp16_to_fp32(blk));
    const float dw = _mm_cvtss_f32(dm);
    const auto wv = block_weights<QT, T>(blk);
    for (int r = 0; r < R; ++r) {
      const __m256i p = block_dot(wv, QT == Q8_0, xq[r] + b * QK);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * xd[r][b]), acc[r]);
    }
    if (QT == Q4_1) {
      const float mw = _mm_cvtss_f32(_mm_movehdup_ps(dm));
      for (int r = 0; r < R; ++r) mins[r] += mw * xs[r][b];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum256(acc[r]) + mins[r];
#else
  for (int r = 0; r < R; ++r) out[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BB;
    const float dw = fp16_to_fp32(blk);
    int32_t wq[QK];
    if (QT == Q8_0) {
      for (int64_t j = 0; j < QK; ++j) wq[j] = reinterpret_cast<const int8_t*>(blk + 2)[j];
    } else {
      for (int64_t j = 0; j < 16; ++j) {
        wq[j] = blk[4 + j] & 0x0f;
        wq[j + 16] = blk[4 + j] >> 4;
      }
    }
    for (int r = 0; r < R; ++r) {
      const T* qx = xq[r] + b * QK;
      int32_t sum = 0;
      for (int64_t j = 0; j < QK; ++j) sum += wq[j] * static_cast<int32_t>(qx[j]);
      out[r] += dw * xd[r][b] * static_cast<float>(sum);
    }
    if (QT == Q4_1) {
      const float mw = fp16_to_fp32(blk + 2);
      for (int r = 0; r < R; ++r) mins[r] += mw * xs[r][b];
    }
  }
  for (int r = 0; r < R; ++r) out[r] += mins[r];
#endif
}

#if TY_AVX2
// out[4g + r] = dot(weight row w, activation row 4g + r) for G groups of 4 activation rows,
// the last group holding `last` (1..4) rows. Each block's integer dot products are summed
// across their lanes first (exact: hadd puts row r's partial sums in lanes r and r + 4),
// so a block costs one conversion and one multiply-add per 4 rows, where dot_rows spends
// them per row and keeps a register per row: up to 12 rows share each unpacked weight
// block here without spilling.
// sd / ss [nb][G][8]: the rows' activation scales d (lanes 4g..4g+3 twice) and, for Q4_1,
// d * sum(q) (low four lanes; zeros above and for missing rows), from `group_scales`.
template <int G, int64_t QT, typename T>
inline void dot_groups(const uint8_t* w, int64_t nb, const T* const* xq, int last,
                       const float* sd, const float* ss, float* out) {
  constexpr int64_t BB = QT == Q8_0 ? 34 : 20;
  constexpr bool S = QT == Q8_0;
  __m256 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BB;
    const __m128 dm = QT == Q4_1 ? q4_1_dm(blk) : _mm_set_ss(fp16_to_fp32(blk));
    const __m256 dw = _mm256_broadcastss_ps(dm);
    const auto wv = block_weights<QT, T>(blk);
    const float* sdb = sd + b * G * 8;
    const int64_t o = b * QK;
    for (int g = 0; g < G; ++g) {
      const T* const* x = xq + 4 * g;
      __m256i p01, p23;
      if (g < G - 1 || last == 4) {
        p01 = _mm256_hadd_epi32(block_dot(wv, S, x[0] + o), block_dot(wv, S, x[1] + o));
        p23 = _mm256_hadd_epi32(block_dot(wv, S, x[2] + o), block_dot(wv, S, x[3] + o));
      } else {
        p01 = _mm256_hadd_epi32(block_dot(wv, S, x[0] + o),
                                last > 1 ? block_dot(wv, S, x[1] + o) : zero);
        p23 = last > 2 ? _mm256_hadd_epi32(block_dot(wv, S, x[2] + o), zero) : zero;
      }
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_hadd_epi32(p01, p23));
      acc[g] = _mm256_fmadd_ps(sums, _mm256_mul_ps(dw, _mm256_loadu_ps(sdb + g * 8)), acc[g]);
    }
    if (QT == Q4_1) {
      const __m256 mw = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
      const float* ssb = ss + b * G * 8;
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(ssb + g * 8), acc[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m128 lanes = _mm_add_ps(_mm256_castps256_ps128(acc[g]), _mm256_extractf128_ps(acc[g], 1));
    _mm_storeu_ps(out + 4 * g, lanes);
  }
}
#endif

// Up to this many activation rows share one unpacked weight block per pass of dot_rows
// (1-3, 5 or 6 rows with AVX2; any number without).
constexpr int MAX_ROWS_PASS = 6;

// Rows [m0, m0 + rows) against weight rows [n0, n1) in passes of dot_rows, spread evenly
// over the passes (8 rows are 4 + 4, not 6 + 2).
template <int64_t QT, typename T>
void rows_in_passes(const uint8_t* wp, int64_t row_bytes, int64_t nb, int64_t K, int64_t m0,
                    int64_t rows_in, int64_t N, const T* xq, const float* xd, const float* xs,
                    float* op, int64_t n0, int64_t n1) {
  const T* q[MAX_ROWS_PASS];
  const float* d[MAX_ROWS_PASS];
  const float* s[MAX_ROWS_PASS];
  float res[MAX_ROWS_PASS];
  const int64_t end_row = m0 + rows_in;
  const int64_t passes = (rows_in + MAX_ROWS_PASS - 1) / MAX_ROWS_PASS;
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int rows = static_cast<int>((end_row - m0 + passes - pass - 1) / (passes - pass));
    for (int r = 0; r < rows; ++r) {
      q[r] = xq + (m0 + r) * K;
      d[r] = xd + (m0 + r) * nb;
      s[r] = xs + (m0 + r) * nb;
    }
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = wp + n * row_bytes;
      switch (rows) {
        case 6: dot_rows<6, QT, T>(wr, nb, q, d, s, res); break;
        case 5: dot_rows<5, QT, T>(wr, nb, q, d, s, res); break;
        case 4: dot_rows<4, QT, T>(wr, nb, q, d, s, res); break;
        case 3: dot_rows<3, QT, T>(wr, nb, q, d, s, res); break;
        case 2: dot_rows<2, QT, T>(wr, nb, q, d, s, res); break;
        default: dot_rows<1, QT, T>(wr, nb, q, d, s, res); break;
      }
      for (int r = 0; r < rows; ++r) op[(m0 + r) * N + n] = res[r];
    }
    m0 += rows;
  }
}

#if TY_AVX2
// Rows a pass of dot_groups takes at most (16 in one pass measured slower than 8 + 8).
constexpr int64_t MAX_GROUP_ROWS = 12;

// The scales of rows [m0, m0 + rows) as dot_groups reads them: sd / ss [nb][G][8],
// G = ceil(rows / 4), zeros for the missing rows of the last group.
inline void group_scales(const float* xd, const float* xs, int64_t nb, int64_t m0,
                         int64_t rows, float* sd, float* ss) {
  const int64_t G = (rows + 3) / 4;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < 4; ++r) {
        const int64_t i = (b * G + g) * 8 + r, m = m0 + 4 * g + r;
        const bool real = 4 * g + r < rows;
        sd[i] = sd[i + 4] = real ? xd[m * nb + b] : 0.f;
        ss[i] = real ? xs[m * nb + b] : 0.f;
        ss[i + 4] = 0.f;
      }
}
#endif

// out rows [begin, end) of x[M, K] @ W^T: weight rows in tiles of ROW_TILE kept hot while
// the activation rows pass over them. With AVX2, 4 or 8 rows or more than 6 go in passes
// of up to 12 (spread evenly, each a multiple of 4 but the last) through dot_groups;
// otherwise passes of dot_rows.
template <int64_t QT, typename T>
void matmul_rows(const uint8_t* wp, int64_t row_bytes, int64_t nb, int64_t K, int64_t M,
                 int64_t N, const T* xq, const float* xd, const float* xs, float* op,
                 int64_t begin, int64_t end) {
#if TY_AVX2
  // Rows that one pass of dot_rows takes (up to 6) stay there unless they make whole
  // groups: a partial group costs more than dot_rows's per-row work (M = 5 measured).
  if (M % 4 == 0 || M > MAX_ROWS_PASS) {
    // (first row, rows) of each pass.
    std::vector<std::pair<int64_t, int64_t>> passes;
    const int64_t n_passes = (M + MAX_GROUP_ROWS - 1) / MAX_GROUP_ROWS;
    for (int64_t m0 = 0, p = 0; m0 < M; ++p) {
      const int64_t even = (M - m0 + n_passes - p - 1) / (n_passes - p);
      const int64_t rows = std::min(M - m0, (even + 3) / 4 * 4);
      passes.emplace_back(m0, rows);
      m0 += rows;
    }
    std::vector<int64_t> scale_off;  // where each pass's scales start in sd / ss
    int64_t scale_len = 0;
    for (const auto& pass : passes) {
      scale_off.push_back(scale_len);
      scale_len += (pass.second + 3) / 4 * 8 * nb;
    }
    std::vector<float> sd(static_cast<size_t>(scale_len)), ss(sd.size());
    for (size_t p = 0; p < passes.size(); ++p)
      group_scales(xd, xs, nb, passes[p].first, passes[p].second, &sd[scale_off[p]], &ss[scale_off[p]]);
    const T* q[MAX_GROUP_ROWS];
    float res[MAX_GROUP_ROWS];
    for (int64_t n0 = begin; n0 < end; n0 += ROW_TILE) {
      const int64_t n1 = std::min(end, n0 + ROW_TILE);
      for (size_t p = 0; p < passes.size(); ++p) {
        const auto [m0, rows] = passes[p];
        const int G = static_cast<int>((rows + 3) / 4), last = static_cast<int>(rows - 4 * (G - 1));
        for (int64_t r = 0; r < rows; ++r) q[r] = xq + (m0 + r) * K;
        const float* sdp = &sd[scale_off[p]];
        const float* ssp = &ss[scale_off[p]];
        for (int64_t n = n0; n < n1; ++n) {
          const uint8_t* wr = wp + n * row_bytes;
          switch (G) {
            case 3: dot_groups<3, QT, T>(wr, nb, q, last, sdp, ssp, res); break;
            case 2: dot_groups<2, QT, T>(wr, nb, q, last, sdp, ssp, res); break;
            default: dot_groups<1, QT, T>(wr, nb, q, last, sdp, ssp, res); break;
          }
          for (int64_t r = 0; r < rows; ++r) op[(m0 + r) * N + n] = res[r];
        }
      }
    }
    return;
  }
#endif
  for (int64_t n0 = begin; n0 < end; n0 += ROW_TILE) {
    rows_in_passes<QT, T>(wp, row_bytes, nb, K, 0, M, N, xq, xd, xs, op, n0, std::min(end, n0 + ROW_TILE));
  }
}

inline void check_weight(const at::Tensor& w, int64_t qtype, int64_t K, const char* op) {
  TORCH_CHECK(qtype == Q8_0 || qtype == Q4_1, op, ": unknown block type ", qtype);
  TORCH_CHECK(K > 0 && K % QK == 0, op, ": in_features must be a multiple of 32");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 &&
                  w.is_contiguous(),
              op, ": weight must be a contiguous 2-D uint8 CPU tensor");
  TORCH_CHECK(w.size(1) == K / QK * block_bytes(qtype), op, ": weight row has ", w.size(1),
              " bytes, expected ", K / QK * block_bytes(qtype));
}

// out[M, N] = x[M, K] @ W[N, K]^T, W in `qtype` blocks (row_bytes a row), x quantized
// per block of 32 to T (int8 or int16). Parallel over output rows.
template <typename T>
void matmul_into(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t row_bytes,
                 int64_t N, int64_t qtype, float* op) {
  const int64_t nb = K / QK;
  std::vector<T> xq(static_cast<size_t>(M * K));
  std::vector<float> xd(static_cast<size_t>(M * nb)), xs(static_cast<size_t>(M * nb));
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      quantize_row(xp + m * K, K, xq.data() + m * K, xd.data() + m * nb, xs.data() + m * nb);
    }
  });
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(ROW_TILE, N / 8));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    if (qtype == Q8_0) {
      matmul_rows<Q8_0, T>(wp, row_bytes, nb, K, M, N, xq.data(), xd.data(), xs.data(), op, begin, end);
    } else {
      matmul_rows<Q4_1, T>(wp, row_bytes, nb, K, M, N, xq.data(), xd.data(), xs.data(), op, begin, end);
    }
  });
}

}  // namespace tyk
