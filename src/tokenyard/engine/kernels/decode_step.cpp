// One whole decode step of a Llama-family decoder in a single call (CPU, float32
// activations, block weights): for each layer, RMSNorm -> QKV (+ bias, per-head q/k norm)
// -> RoPE -> K/V written into the paged cache -> paged attention -> o_proj -> residual ->
// RMSNorm -> gate/up -> SiLU * up -> down -> residual; then the final RMSNorm. LoRA
// adapters, one per row or none, add their update to each projection they adapt.
//
// The matmuls and the attention are the code of quant_matmul.cpp and paged_decode.cpp
// (quant_core.h, attention_core.h), so this op computes what the eager torch path
// computes op by op (models/llama.py with PagedAttention), without ~25 dispatched ops a
// layer between them. The matmuls and the attention are parallel over output rows and
// (chunk, kv head) items with at::parallel_for; the element-wise work is small and serial.
//
// A row is one token with its own context length, so a prompt's tail over its cached
// prefix (a prefix-cache hit) runs here too, each tail token a row: consecutive rows of
// one sequence (the same blocks, positions and lengths one apart) are attended as chunks
// whose positions fold into the kv heads' query groups (attention_core.h's `tail`), so a
// cached K/V row is read once per chunk, not once per row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_core.h"
#include "quant_core.h"

namespace {

// y = x * rsqrt(mean(x^2) + eps) * w over n values (w may be null: no weight).
void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y) {
  float ss = 0.f;
  for (int64_t j = 0; j < n; ++j) ss += x[j] * x[j];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) y[j] = w == nullptr ? x[j] * r : x[j] * r * w[j];
}

// x[D] rotated in the "rotate half" layout by cos/sin [D / 2], into out[D].
void rope(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    out[j] = a * c[j] - b * s[j];
    out[j + half] = b * c[j] + a * s[j];
  }
}

// gate[n] <- silu(gate) * up, silu(g) = g / (1 + exp(-g)).
void silu_mul(float* gate, const float* up, int64_t n) {
  for (int64_t j = 0; j < n; ++j) gate[j] = gate[j] / (1.0f + std::exp(-gate[j])) * up[j];
}

void matmul(const float* x, int64_t M, int64_t K, const at::Tensor& w, int64_t qtype,
            int64_t act_bits, float* out) {
  const int64_t N = w.size(0), row_bytes = w.size(1);
  if (act_bits == 8) {
    tyk::matmul_into<int8_t>(x, M, K, w.data_ptr<uint8_t>(), row_bytes, N, qtype, out);
  } else {
    tyk::matmul_into<int16_t>(x, M, K, w.data_ptr<uint8_t>(), row_bytes, N, qtype, out);
  }
}

void add_bias(float* y, const at::Tensor& bias, int64_t M, int64_t N) {
  if (!bias.defined() || bias.numel() == 0) return;
  const float* b = bias.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < N; ++j) y[m * N + j] += b[j];
}

bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// The LoRA adapters of one step (engine/lora/bank.py): per projection every slot's A
// stacked [S * w, in] and B transposed [S * w, out], w = slices * width (q/k/v: 3 slices,
// gate/up: 2, o and down: 1), each slot's rank on each slice [S, slices] (0: none; the
// ranks above it are zero), and each row's slot (0: none).
struct Lora {
  at::TensorList a, bt, ranks;
  const int64_t* slots = nullptr;
  int64_t width = 0;
};

// Multiply-adds of LoRA rows a thread takes at least.
constexpr int64_t LORA_GRAIN = 1 << 15;

// out[m] += B_s (A_s x[m]) for each row m of a slot s > 0, slice by slice, over the ranks
// the slot's adapter has there only: a slice's ranks write its own output columns only
// (B is zero elsewhere). Parallel over rows, a thread taking at least LORA_GRAIN
// multiply-adds (one row of a small adapter costs less than waking the threads).
void lora_add(const Lora& lora, int64_t index, const float* x, int64_t M, int64_t K,
              const std::vector<int64_t>& sizes, float* out) {
  if (lora.slots == nullptr || !present(lora.a[index])) return;
  const int64_t n_slices = static_cast<int64_t>(sizes.size());
  const int64_t r = lora.width, w = n_slices * r;
  int64_t N = 0;
  for (int64_t n : sizes) N += n;
  const float* ap = lora.a[index].data_ptr<float>();
  const float* bp = lora.bt[index].data_ptr<float>();
  const int64_t* rp = lora.ranks[index].data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, LORA_GRAIN / (w * K + r * N));
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int64_t s = lora.slots[m];
      if (s <= 0) continue;
      float* om = out + m * N;
      int64_t col = 0;
      for (int64_t i = 0; i < n_slices; ++i) {
        const int64_t first = (s - 1) * w + i * r;
        for (int64_t k = 0; k < rp[(s - 1) * n_slices + i]; ++k) {
          const float h = tyk::dot(ap + (first + k) * K, x + m * K, K);
          tyk::axpy(om + col, h, bp + (first + k) * N + col, sizes[i]);
        }
        col += sizes[i];
      }
    }
  });
}

// Rows [first, first + rows) attended as one folded row (their query positions in the kv
// heads' query groups), the last row's block table and context length standing for all.
struct Chunk {
  int64_t first, rows;
};

// Runs of rows of one sequence at consecutive positions, each cut into chunks: two when
// its length is even (the work items are (chunk, kv head): with 3 kv heads one chunk
// would leave a second thread a third of the work; paged_attention._tail_chunks cuts the
// eager path's tails alike), else one. A decode row is a chunk of one.
std::vector<Chunk> fold_chunks(const int64_t* tables, const int64_t* lens, const int64_t* pos,
                               int64_t M, int64_t W, int64_t BS) {
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < M;) {
    int64_t j = i + 1;
    while (j < M && lens[j] == lens[j - 1] + 1 && pos[j] == pos[j - 1] + 1 &&
           std::equal(tables + (j - 1) * W, tables + (j - 1) * W + (lens[j - 1] + BS - 1) / BS,
                      tables + j * W))
      ++j;
    const int64_t n = j - i, parts = n % 2 == 0 ? 2 : 1;
    for (int64_t p = 0; p < parts; ++p) chunks.push_back({i + p * (n / parts), n / parts});
    i = j;
  }
  return chunks;
}

// A chunk's queries [rows][H][D] -> its folded row [KVH][rows][G1][D] (G1 = H / KVH),
// or back (to_folded false).
void fold(const float* src, int64_t rows, int64_t H, int64_t KVH, int64_t D, float* dst,
          bool to_folded) {
  const int64_t G1 = H / KVH;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      const int64_t plain = (r * H + kvh * G1) * D, folded = ((kvh * rows + r) * G1) * D;
      if (to_folded)
        std::copy_n(src + plain, G1 * D, dst + folded);
      else
        std::copy_n(src + folded, G1 * D, dst + plain);
    }
}

void check_float(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.numel() == numel,
              "decode_layers: ", what, " must be a contiguous float32 CPU tensor of ", numel,
              " values");
}

// Final-normed hidden states [M, hidden] of M tokens, each a row with its own context: one
// per sequence (a decode step), or a few consecutive ones of a sequence whose earlier
// tokens are cached (a prompt's tail; its rows' k/v are all written before any attends).
//   x: [M, hidden] embeddings; norms: 2 per layer (input, post-attention) then the final
//   norm; weights / qtypes: 4 per layer (qkv, o, gate_up, down) as quant_matmul takes
//   them; biases: 2 per layer (qkv, o; empty when none); qk_norms: 1 per layer
//   ([heads + kv_heads, D]; empty when none); k_cache / v_cache: [layers, blocks, BS,
//   kv_heads, D]; slots [M]: the cache slot of each token's k/v; block_tables [M, W] and
//   context_lens [M] as paged_decode takes them (context includes this token);
//   positions [M]; cos / sin: [max_positions, D / 2]. LoRA adapters (none: empty lists):
//   lora_a / lora_bt / lora_ranks 4 per layer as `Lora` holds them (empty: a projection no
//   adapter touches), lora_slots [M] int64 each row's slot (0: none), lora_width the
//   slots' rank width per slice (the engine's max LoRA rank).
at::Tensor decode_layers(const at::Tensor& x_in, at::TensorList norms, at::TensorList weights,
                         at::IntArrayRef qtypes, at::TensorList biases, at::TensorList qk_norms,
                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slots_in, const at::Tensor& tables_in,
                         const at::Tensor& lens_in, const at::Tensor& positions_in,
                         const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                         int64_t num_kv_heads, double eps_in, int64_t act_bits,
                         at::TensorList lora_a, at::TensorList lora_bt,
                         at::TensorList lora_ranks, const at::Tensor& lora_slots_in,
                         int64_t lora_width) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "decode_layers: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "decode_layers: act_bits must be 8 or 16");
  const int64_t L = static_cast<int64_t>(weights.size()) / 4;
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == 4 * L &&
                  static_cast<int64_t>(qtypes.size()) == 4 * L &&
                  static_cast<int64_t>(norms.size()) == 2 * L + 1 &&
                  static_cast<int64_t>(biases.size()) == 2 * L &&
                  static_cast<int64_t>(qk_norms.size()) == L,
              "decode_layers: per-layer lists of inconsistent lengths");
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == L &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              "decode_layers: caches must be contiguous float32 or float16 [layers, blocks, BS, "
              "KVH, D]");
  const int64_t M = x_in.size(0), Hd = x_in.size(1);
  const int64_t NB = k_cache.size(1), BS = k_cache.size(2), KVH = k_cache.size(3),
                D = k_cache.size(4);
  const int64_t H = num_heads, half = D / 2;
  TORCH_CHECK(KVH == num_kv_heads && H % KVH == 0 && D % 2 == 0, "decode_layers: head shapes");
  const int64_t QKV = (H + 2 * KVH) * D;
  const int64_t I = weights[2].size(0) / 2;
  // Each projection's LoRA output slices: q/k/v, o, gate/up, down.
  const std::vector<int64_t> lora_sizes[4] = {{H * D, KVH * D, KVH * D}, {Hd}, {I, I}, {Hd}};
  Lora lora;
  at::Tensor lora_slots;
  if (!lora_a.empty()) {
    lora_slots = lora_slots_in.contiguous();
    TORCH_CHECK(static_cast<int64_t>(lora_a.size()) == 4 * L && lora_bt.size() == lora_a.size() &&
                    lora_ranks.size() == lora_a.size() && lora_width > 0 &&
                    lora_slots.scalar_type() == at::kLong && lora_slots.numel() == M,
                "decode_layers: LoRA lists of 4 per layer, a width, one int64 slot per row");
    lora = {lora_a, lora_bt, lora_ranks, lora_slots.data_ptr<int64_t>(), lora_width};
  }
  for (int64_t l = 0; l < L; ++l) {
    const int64_t in_features[4] = {Hd, H * D, Hd, I};
    const int64_t out_features[4] = {QKV, Hd, 2 * I, Hd};
    for (int64_t k = 0; k < 4; ++k) {
      tyk::check_weight(weights[4 * l + k], qtypes[4 * l + k], in_features[k], "decode_layers");
      TORCH_CHECK(weights[4 * l + k].size(0) == out_features[k], "decode_layers: layer ", l,
                  " weight ", k, " has ", weights[4 * l + k].size(0), " rows");
      if (lora.slots == nullptr || !present(lora_a[4 * l + k])) continue;
      const int64_t n_slices = static_cast<int64_t>(lora_sizes[k].size());
      const int64_t w = n_slices * lora_width;
      const at::Tensor &a = lora_a[4 * l + k], &bt = lora_bt[4 * l + k];
      const at::Tensor& ranks = lora_ranks[4 * l + k];
      TORCH_CHECK(a.dim() == 2 && a.size(1) == in_features[k] && a.size(0) % w == 0,
                  "decode_layers: layer ", l, " LoRA A ", k, " must be [slots * ", w, ", ",
                  in_features[k], "]");
      const int64_t num_slots = a.size(0) / w;
      check_float(a, num_slots * w * in_features[k], "LoRA A");
      check_float(bt, num_slots * w * out_features[k], "LoRA B");
      TORCH_CHECK(bt.dim() == 2 && bt.size(0) == a.size(0), "decode_layers: LoRA B rows");
      TORCH_CHECK(ranks.device().is_cpu() && ranks.scalar_type() == at::kLong &&
                      ranks.is_contiguous() && ranks.numel() == num_slots * n_slices,
                  "decode_layers: LoRA ranks must be contiguous int64 [slots, slices]");
      const int64_t* rp = ranks.data_ptr<int64_t>();
      for (int64_t j = 0; j < num_slots * n_slices; ++j)
        TORCH_CHECK(rp[j] >= 0 && rp[j] <= lora_width, "decode_layers: LoRA rank out of range");
      for (int64_t m = 0; m < M; ++m)
        TORCH_CHECK(lora.slots[m] >= 0 && lora.slots[m] <= num_slots,
                    "decode_layers: LoRA slot out of range");
    }
    check_float(norms[2 * l], Hd, "input norm");
    check_float(norms[2 * l + 1], Hd, "post-attention norm");
    if (present(biases[2 * l])) check_float(biases[2 * l], QKV, "qkv bias");
    if (present(biases[2 * l + 1])) check_float(biases[2 * l + 1], Hd, "o bias");
    if (present(qk_norms[l])) check_float(qk_norms[l], (H + KVH) * D, "q/k norm");
  }
  check_float(norms[2 * L], Hd, "final norm");
  const at::Tensor slots = slots_in.contiguous(), tables = tables_in.contiguous();
  const at::Tensor lens = lens_in.contiguous(), positions = positions_in.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && tables.scalar_type() == at::kLong &&
                  lens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong,
              "decode_layers: int64 slots, block tables, lengths and positions");
  TORCH_CHECK(slots.numel() == M && lens.numel() == M && positions.numel() == M &&
                  tables.dim() == 2 && tables.size(0) == M,
              "decode_layers: one slot, length, position and table row per token");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(1) == half,
              "decode_layers: cos / sin must be contiguous float32 [positions, D / 2]");
  const int64_t W = tables.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  int64_t max_ctx = 0;
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= W * BS, "decode_layers: context length out of range");
    TORCH_CHECK(sp[i] >= 0 && sp[i] < NB * BS, "decode_layers: slot out of range");
    TORCH_CHECK(pp[i] >= 0 && pp[i] < cos.size(0), "decode_layers: position out of range");
    for (int64_t b = 0; b < (lp[i] + BS - 1) / BS; ++b)
      TORCH_CHECK(tp[i * W + b] >= 0 && tp[i * W + b] < NB, "decode_layers: block out of range");
    max_ctx = std::max(max_ctx, lp[i]);
  }

  at::Tensor out = at::empty({M, Hd}, x_in.options());
  std::vector<float> x(static_cast<size_t>(M * Hd)), h(x.size()), y(x.size());
  std::vector<float> qkv(static_cast<size_t>(M * QKV)), q(static_cast<size_t>(M * H * D));
  std::vector<float> attn(q.size()), gu(static_cast<size_t>(M * 2 * I)), act(static_cast<size_t>(M * I));
  const std::vector<Chunk> chunks = fold_chunks(tp, lp, pp, M, W, BS);
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
  // Queries and outputs of folded chunks (none in a step of decode rows only).
  std::vector<float> qf(n_chunks < M ? q.size() : 0), af(qf.size());
  std::copy_n(x_in.contiguous().data_ptr<float>(), M * Hd, x.data());
  const float eps = static_cast<float>(eps_in);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t layer_stride = NB * BS * KVH * D;
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();

  std::vector<float> krow(static_cast<size_t>(D));
  // Every layer, over a cache of float32 or float16 (tyk::half_t) elements.
  auto run_layers = [&](auto* kc, auto* vc) {
    for (int64_t l = 0; l < L; ++l) {
      auto* kl = kc + l * layer_stride;
      auto* vl = vc + l * layer_stride;
      const float* nin = norms[2 * l].data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) rms_norm(&x[m * Hd], nin, Hd, eps, &h[m * Hd]);
      matmul(h.data(), M, Hd, weights[4 * l], qtypes[4 * l], act_bits, qkv.data());
      add_bias(qkv.data(), biases[2 * l], M, QKV);
      lora_add(lora, 4 * l, h.data(), M, Hd, lora_sizes[0], qkv.data());
      const float* qkn = present(qk_norms[l]) ? qk_norms[l].data_ptr<float>() : nullptr;
      for (int64_t m = 0; m < M; ++m) {
        float* row = &qkv[m * QKV];
        if (qkn != nullptr) {
          for (int64_t hh = 0; hh < H + KVH; ++hh) rms_norm(row + hh * D, qkn + hh * D, D, eps, row + hh * D);
        }
        const float* c = cp + pp[m] * half;
        const float* s = snp + pp[m] * half;
        for (int64_t hh = 0; hh < H; ++hh) rope(row + hh * D, c, s, D, &q[(m * H + hh) * D]);
        const int64_t slot = (sp[m] / BS) * BS * KVH * D + (sp[m] % BS) * KVH * D;
        for (int64_t hh = 0; hh < KVH; ++hh) {
          rope(row + (H + hh) * D, c, s, D, krow.data());
          tyk::store_row(kl + slot + hh * D, krow.data(), D);
          tyk::store_row(vl + slot + hh * D, row + (H + KVH + hh) * D, D);
        }
      }
      if (n_chunks == M) {  // decode rows only: (row, kv head) items, nothing to fold
        at::parallel_for(0, M * KVH, 1, [&](int64_t begin, int64_t end) {
          tyk::attend_items(begin, end, q.data(), kl, vl, tp, lp, H, KVH, D, BS, W, max_ctx,
                            scale, attn.data());
        });
      } else {
        for (const Chunk& c : chunks) fold(&q[c.first * H * D], c.rows, H, KVH, D, &qf[c.first * H * D], true);
        at::parallel_for(0, n_chunks * KVH, 1, [&](int64_t begin, int64_t end) {
          // The thread's items of each chunk in one call (its kv heads kvh0..kvh1).
          for (int64_t item = begin; item < end;) {
            const Chunk& c = chunks[item / KVH];
            const int64_t kvh0 = item % KVH, kvh1 = std::min(KVH, kvh0 + end - item);
            const int64_t last = c.first + c.rows - 1, off = c.first * H * D;
            tyk::attend_items(kvh0, kvh1, &qf[off], kl, vl, tp + last * W, lp + last,
                              H * c.rows, KVH, D, BS, W, max_ctx, scale, &af[off], c.rows);
            item += kvh1 - kvh0;
          }
        });
        for (const Chunk& c : chunks) fold(&af[c.first * H * D], c.rows, H, KVH, D, &attn[c.first * H * D], false);
      }
      matmul(attn.data(), M, H * D, weights[4 * l + 1], qtypes[4 * l + 1], act_bits, y.data());
      add_bias(y.data(), biases[2 * l + 1], M, Hd);
      lora_add(lora, 4 * l + 1, attn.data(), M, H * D, lora_sizes[1], y.data());
      for (int64_t j = 0; j < M * Hd; ++j) x[j] += y[j];

      const float* npost = norms[2 * l + 1].data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) rms_norm(&x[m * Hd], npost, Hd, eps, &h[m * Hd]);
      matmul(h.data(), M, Hd, weights[4 * l + 2], qtypes[4 * l + 2], act_bits, gu.data());
      lora_add(lora, 4 * l + 2, h.data(), M, Hd, lora_sizes[2], gu.data());
      at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m) {
          std::copy_n(&gu[m * 2 * I], I, &act[m * I]);
          silu_mul(&act[m * I], &gu[m * 2 * I + I], I);
        }
      });
      matmul(act.data(), M, I, weights[4 * l + 3], qtypes[4 * l + 3], act_bits, y.data());
      lora_add(lora, 4 * l + 3, act.data(), M, I, lora_sizes[3], y.data());
      for (int64_t j = 0; j < M * Hd; ++j) x[j] += y[j];
    }
  };
  if (k_cache.scalar_type() == at::kHalf)
    run_layers(static_cast<tyk::half_t*>(k_cache.data_ptr()),
               static_cast<tyk::half_t*>(v_cache.data_ptr()));
  else
    run_layers(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  const float* nfin = norms[2 * L].data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) rms_norm(&x[m * Hd], nfin, Hd, eps, op + m * Hd);
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenyard_decode, m) {
  m.def("decode_layers", decode_layers);  // one decode step through every layer
}
