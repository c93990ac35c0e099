// Matmul against weights kept in ggml block formats (CPU).
//
// A weight is a uint8 tensor [N, nb * block_bytes]: each row holds nb blocks of 32 input
// values, byte for byte as in a GGUF file:
//   Q8_0 (34 bytes): fp16 d, int8 q[32];            w = d * q
//   Q4_1 (20 bytes): fp16 d, fp16 m, uint8 qs[16];  w = d * q + m, q[j] = qs[j] & 15,
//                                                  q[j + 16] = qs[j] >> 4
// Activations are quantized per row and block of 32 to int8 (d = max|x| / 127) or int16
// (d = max|x| / 32767), so an outlier channel only costs precision inside its own block.
// Each block's dot product is an integer one (AVX2: maddubs + madd for int8, madd for
// int16), scaled by the two scales in float (FMA); for Q4_1 the weight's offset adds
// m * d_x * sum(q_x), kept per activation block. Work is split over output rows
// (at::parallel_for, torch's intra-op threads); with AVX2 up to 12 activation rows (in
// groups of 4 whose integer sums are reduced together, quant_core.h's dot_groups) share
// each unpacked weight block, and 1-3, 5 or 6 rows take one pass of dot_rows. Without
// AVX2/FMA/F16C a scalar path computes the same.
// Registered as torch ops (torch.ops.tokenyard_quant.*) with the light ATen headers
// only: torch/extension.h would quadruple the compile time (~50 s against ~12 s here).
#include <ATen/ops/empty.h>

#include "quant_core.h"

namespace {

using namespace tyk;

template <typename T>
at::Tensor quant_matmul_t(const at::Tensor& x, const at::Tensor& w, int64_t qtype) {
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  matmul_into<T>(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<uint8_t>(), w.size(1),
                 w.size(0), qtype, out.data_ptr<float>());
  return out;
}

// y[M, N] = x[M, K] @ W[N, K]^T with W in blocks (qtype) and x quantized per block of 32
// to act_bits (8 or 16) bit integers.
at::Tensor quant_matmul(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t act_bits) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "quant_matmul: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "quant_matmul: act_bits must be 8 or 16");
  check_weight(w, qtype, x_in.size(1), "quant_matmul");
  const at::Tensor x = x_in.contiguous();
  return act_bits == 8 ? quant_matmul_t<int8_t>(x, w, qtype) : quant_matmul_t<int16_t>(x, w, qtype);
}

inline void dequantize_row(const uint8_t* w, int64_t qtype, int64_t nb, float* out) {
#if TY_AVX2
  for (int64_t b = 0; b < nb; ++b) {
    float* o = out + b * QK;
    if (qtype == Q8_0) {
      const uint8_t* blk = w + b * 34;
      const __m256 dw = _mm256_set1_ps(fp16_to_fp32(blk));
      for (int j = 0; j < 4; ++j) {
        const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * j));
        _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(dw, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8))));
      }
    } else {
      const uint8_t* blk = w + b * 20;
      const __m256 dw = _mm256_set1_ps(fp16_to_fp32(blk));
      const __m256 mw = _mm256_set1_ps(fp16_to_fp32(blk + 2));
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0f));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int j = 0; j < 4; ++j) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
        _mm256_storeu_ps(o + 8 * j, _mm256_fmadd_ps(dw, q, mw));
      }
    }
  }
  return;
#endif
  for (int64_t b = 0; b < nb; ++b) {
    float* o = out + b * QK;
    if (qtype == Q8_0) {
      const uint8_t* blk = w + b * 34;
      const float dw = fp16_to_fp32(blk);
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int64_t j = 0; j < QK; ++j) o[j] = dw * static_cast<float>(q[j]);
    } else {
      const uint8_t* blk = w + b * 20;
      const float dw = fp16_to_fp32(blk);
      const float mw = fp16_to_fp32(blk + 2);
      const uint8_t* qs = blk + 4;
      for (int64_t j = 0; j < 16; ++j) {
        o[j] = dw * static_cast<float>(qs[j] & 0x0f) + mw;
        o[j + 16] = dw * static_cast<float>(qs[j] >> 4) + mw;
      }
    }
  }
}

// All rows of W as float32 into out [N, K] (a caller's scratch: a fresh tile of a few MB
// would cost more in page faults than the dequantization itself).
void dequantize_out(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& out) {
  check_weight(w, qtype, K, "dequantize");
  const int64_t N = w.size(0), nb = K / QK, row_bytes = w.size(1);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == N && out.size(1) == K,
              "dequantize: out must be a contiguous float32 [N, K] tensor");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequantize_row(wp + n * row_bytes, qtype, nb, op + n * K);
  });
}

// All rows of W as float32 [N, K].
at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t K) {
  at::Tensor out = at::empty({w.size(0), K}, at::TensorOptions().dtype(at::kFloat));
  dequantize_out(w, qtype, K, out);
  return out;
}

// Rows ids[T] of W as float32 [T, K]: the embedding lookup of a block-quantized table.
at::Tensor embedding(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& ids_in) {
  check_weight(w, qtype, K, "embedding");
  TORCH_CHECK(ids_in.scalar_type() == at::kLong && ids_in.dim() == 1, "embedding: ids must be 1-D int64");
  const at::Tensor ids = ids_in.contiguous();
  const int64_t T = ids.size(0), N = w.size(0), nb = K / QK, row_bytes = w.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "embedding: token id ", ip[t], " out of range");
  }
  at::Tensor out = at::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) dequantize_row(wp + ip[t] * row_bytes, qtype, nb, op + t * K);
  });
  return out;
}

bool has_avx2() { return TY_AVX2 != 0; }
#ifdef TY_DPBUSD
bool has_vnni() { return true; }
#else
bool has_vnni() { return false; }
#endif

}  // namespace

TORCH_LIBRARY(tokenyard_quant, m) {
  m.def("quant_matmul", quant_matmul);  // x @ W^T, W in Q8_0/Q4_1 blocks
  m.def("dequantize", dequantize);      // blocks -> float32 [N, K]
  m.def("dequantize_out", dequantize_out);  // blocks -> a given float32 [N, K] buffer
  m.def("embedding", embedding);        // rows ids of a block table -> float32 [T, K]
  m.def("has_avx2", has_avx2);          // whether the AVX2/FMA/F16C path was compiled in
  m.def("has_vnni", has_vnni);          // whether its int8 dot products use VNNI
}
