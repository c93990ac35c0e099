// Decode attention straight over the paged KV cache (CPU; a float32 or float16 cache,
// float32 queries and output).
//
// One work item is (decode row, kv head): the head's whole query group is scored against
// each cached K row while that row is in L1, so every K/V row of the context is read from
// memory once. Scores for the row live in a small per-thread buffer (two-pass softmax:
// scores + max, then exp + sum, then the weighted sum of V).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "attention_core.h"


torch::Tensor paged_decode(
    const torch::Tensor& q,             // [N, H, D]
    const torch::Tensor& k_cache,       // [num_blocks, block_size, KVH, D]
    const torch::Tensor& v_cache,       // [num_blocks, block_size, KVH, D]
    const torch::Tensor& block_tables,  // [N, max_blocks] int64
    const torch::Tensor& context_lens,  // [N] int64
    double scale,
    int64_t tail) {                     // query positions folded into each row (attention_core.h)
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode: CPU tensors only");
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && v_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || cache_type == at::kHalf),
              "paged_decode: float32 queries, and a float32 or float16 cache");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode: bad ranks");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: cache not contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_decode: k/v cache shapes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode: int64 block tables and context lengths");

  const auto qc = q.contiguous();
  const auto bt = block_tables.contiguous();
  const auto cl = context_lens.contiguous();
  const int64_t N = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t num_blocks = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "paged_decode: head_dim mismatch");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "paged_decode: heads not a multiple of kv heads");
  TORCH_CHECK(tail >= 1 && (H / KVH) % tail == 0, "paged_decode: tail does not divide the group");
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == N && cl.dim() == 1 && cl.size(0) == N,
              "paged_decode: block table / context length shapes");
  const int64_t max_blocks = bt.size(1);

  const int64_t* lens = cl.data_ptr<int64_t>();
  const int64_t* tables = bt.data_ptr<int64_t>();
  int64_t max_ctx = 0;
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(lens[i] >= tail && lens[i] <= max_blocks * BS, "paged_decode: context length out of range");
    max_ctx = std::max(max_ctx, lens[i]);
  }
  for (int64_t i = 0; i < N; ++i) {
    const int64_t used = (lens[i] + BS - 1) / BS;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t blk = tables[i * max_blocks + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_decode: block id out of range");
    }
  }

  auto out = torch::empty({N, H, D}, qc.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  auto run = [&](auto* kp, auto* vp) {
    at::parallel_for(0, N * KVH, 1, [&](int64_t begin, int64_t end) {
      tyk::attend_items(begin, end, qp, kp, vp, tables, lens, H, KVH, D, BS, max_blocks,
                        max_ctx, fscale, op, tail);
    });
  };
  if (cache_type == at::kHalf)
    run(static_cast<const tyk::half_t*>(k_cache.data_ptr()),
        static_cast<const tyk::half_t*>(v_cache.data_ptr()));
  else
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  return out;
}

bool has_avx2() { return TY_AVX2 != 0; }

// The portable binary16 conversions (what builds without F16C use), for the tests:
// float32 -> the half's bits as int16, and back.
torch::Tensor to_half_bits(const torch::Tensor& x) {
  const auto xc = x.contiguous().to(at::kFloat);
  auto out = torch::empty(xc.sizes(), xc.options().dtype(at::kShort));
  const float* src = xc.data_ptr<float>();
  auto* dst = static_cast<tyk::half_t*>(out.data_ptr());
  for (int64_t i = 0; i < xc.numel(); ++i) dst[i] = tyk::float_to_half(src[i]);
  return out;
}

torch::Tensor from_half_bits(const torch::Tensor& bits) {
  TORCH_CHECK(bits.scalar_type() == at::kShort, "from_half_bits: int16 bits");
  const auto bc = bits.contiguous();
  auto out = torch::empty(bc.sizes(), bc.options().dtype(at::kFloat));
  const auto* src = static_cast<const tyk::half_t*>(bc.data_ptr());
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < bc.numel(); ++i) dst[i] = tyk::half_to_float(src[i]);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Decode attention over a paged KV cache (CPU; float32 or float16 cache)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("tail") = 1);
  m.def("has_avx2", &has_avx2, "Whether the AVX2/FMA path was compiled in");
  m.def("to_half_bits", &to_half_bits, "float32 -> binary16 bits (portable conversion)");
  m.def("from_half_bits", &from_half_bits, "binary16 bits -> float32 (portable conversion)");
}
