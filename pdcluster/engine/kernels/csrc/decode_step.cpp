// A batch-1 decode step's whole layer stack as one op (CPU, float32): the same kernels, in
// the same order, as the model's Python forward takes one by one (engine/models/llama.py with
// the kernels on), so the tokens are bit for bit the same. What it removes is the trip back to
// Python between them: a 30-layer decoder otherwise makes ~300 op calls a token, each with its
// Python frames, argument checks and dispatch (about 4 ms of a 22 ms SmolLM2-135M step).
//
// torch.ops.pdcluster.decode_layers_(x [1, H] (the token's embedding; the residual stream,
//   updated in place), positions [1], weights (6 per layer: input norm [H], qkv [(Hq + 2 Hkv) D,
//   H], o [H, Hq D], post-attention norm [H], gate_up [2 I, H], down [H, I]), final_norm [H],
//   eps, cos, sin, heads, kv_heads, cache_rows, row_offsets, value_offset and head_stride
//   (each layer's rows in cache_rows, as rope_and_cache_ takes them: PagedKVCache's
//   key_row_offset, the block size and head_stride), k_caches, v_caches (one [NB, BS, Hkv, D] view per layer), slot_rows [1],
//   block_table [1, MB], context_lens [1], scale) -> [1, H]
//   the final norm's output: what CausalLM.forward returns for the token.
// Dense layers without biases only (Llama, Mistral, Qwen3 without q/k norms, SmolLM); the
// model takes its Python path for anything else.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels.h"

namespace {

constexpr int64_t kWeightsPerLayer = 6;  // input norm, qkv, o, post norm, gate_up, down

}  // namespace

namespace pdcluster {

at::Tensor decode_layers_(const at::Tensor& x, const at::Tensor& positions,
                          at::TensorList weights, const at::Tensor& final_norm, double eps,
                          const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                          int64_t kv_heads, const at::Tensor& cache_rows,
                          at::IntArrayRef row_offsets, int64_t value_offset,
                          int64_t head_stride, at::TensorList k_caches, at::TensorList v_caches,
                          const at::Tensor& slot_rows, const at::Tensor& block_table,
                          const at::Tensor& context_lens, double scale) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer &&
                  static_cast<int64_t>(row_offsets.size()) == layers,
              "decode_layers_: expected ", kWeightsPerLayer, " weights, a row offset and a k "
              "and v cache view per layer");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous() &&
                  x.scalar_type() == at::kFloat,
              "decode_layers_: x must be one contiguous float32 token [1, H]");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
              "decode_layers_: heads must be a multiple of kv_heads");
  const int64_t dim = cos.size(1), q_size = heads * dim;
  const at::Tensor& residual = x;  // the stream every layer adds to, in place
  at::Tensor out;                  // the previous layer's output
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    at::Tensor h;
    if (layer == 0) {
      h = rms_norm(residual, w[0], eps);
    } else {
      add_rms_norm_(out, residual, w[0], eps);  // residual += out; out = norm(residual)
      h = out;
    }
    at::Tensor qkv = gemv(h, w[1], c10::nullopt);
    rope_and_cache_(qkv, positions, cos, sin, heads, kv_heads, cache_rows, slot_rows,
                    row_offsets[layer], value_offset, head_stride);
    // a KV head's query heads as the rows of one matrix, as engine/models/attention.py lays them out
    at::Tensor rows = qkv.narrow(1, 0, q_size).reshape({1, kv_heads, heads / kv_heads, dim})
                          .contiguous();
    at::Tensor attended = std::get<0>(paged_attention(rows, k_caches[layer], v_caches[layer],
                                                      block_table, context_lens, scale));
    at::Tensor o = gemv(attended.view({1, q_size}), w[2], c10::nullopt);
    add_rms_norm_(o, residual, w[3], eps);
    const int64_t intermediate = w[4].size(0) / 2;
    out = gemv(gemv_swiglu(o, w[4], c10::nullopt, intermediate), w[5], c10::nullopt);
  }
  add_rms_norm_(out, residual, final_norm, eps);
  return out;
}

}  // namespace pdcluster

TORCH_LIBRARY_FRAGMENT(pdcluster, m) {
  m.def(
      "decode_layers_(Tensor(a!) x, Tensor positions, Tensor[] weights, Tensor final_norm, "
      "float eps, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor(b!) cache_rows, "
      "int[] row_offsets, int value_offset, int head_stride, Tensor[] k_caches, "
      "Tensor[] v_caches, Tensor slot_rows, Tensor block_table, "
      "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdcluster, CPU, m) { m.impl("decode_layers_", &pdcluster::decode_layers_); }
