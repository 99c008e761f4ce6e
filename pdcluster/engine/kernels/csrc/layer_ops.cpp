// The small per-layer steps of a decoder as one op each (CPU, float32), in place of the
// handful of torch ops each takes: a decode step of a 30-layer model otherwise launches ~1,000
// ops, most of them on one token.
//
// torch.ops.pdcluster.rms_norm(x [T, H], weight [H], eps) -> weight * (x * rsqrt(mean(x^2) + eps))
// torch.ops.pdcluster.add_rms_norm_(x [T, H], residual [T, H], weight, eps)
//   residual += x, then x = rms_norm(residual): the residual stream and the next norm in one
//   pass (vLLM's fused_add_rms_norm)
// torch.ops.pdcluster.rope_and_cache_(qkv [T, (Hq + 2 Hkv) D], positions [T], cos [P, D],
//   sin [P, D], Hq, Hkv, cache_rows [R, D], slot_rows [T], row_offset, value_offset,
//   head_stride)
//   rotates every q and k head of each token in place (rotate-half RoPE: x cos +
//   rotate_half(x) sin, element for element as transformers computes it), then copies KV head
//   h of the token's k and v into rows slot_rows[t] + row_offset + h head_stride (+
//   value_offset for v) of the cache (engine/kv/kv_cache.py's row view of the region: a row is
//   one head's vector; the offset picks the layer).
//
// This file is compiled like the others (-ffp-contract=off keeps a * b + c as two roundings,
// as torch's separate ops do): RoPE's output is bit-identical to transformers'.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                  t.is_contiguous(),
              name, ": expected a contiguous float32 CPU tensor [T, H]");
}

void normalize_row(const float* in, const float* weight, int64_t n, float eps, float* out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += in[i] * in[i];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (in[i] * inv);
}

}  // namespace

namespace pdcluster {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  weight.numel() == x.size(1),
              "rms_norm: weight must be a contiguous float32 [H]");
  auto out = at::empty_like(x);
  const int64_t n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      normalize_row(xp + t * n, wp, n, static_cast<float>(eps), op + t * n);
  });
  return out;
}

void add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  TORCH_CHECK(x.sizes() == residual.sizes() && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat && weight.numel() == x.size(1),
              "add_rms_norm_: x, residual [T, H] and weight [H] disagree");
  const int64_t n = x.size(1);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = rp + t * n;
      float* h = xp + t * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) r[i] = r[i] + h[i];
      normalize_row(r, wp, n, static_cast<float>(eps), h);
    }
  });
}

// One head [D] in place: first half x1 cos - x2 sin, second half x2 cos + x1 sin.
inline void rotate(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] + (-x2) * sin[i];
    x[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
  }
}

void rope_and_cache_(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                     const at::Tensor& cache_rows, const at::Tensor& slot_rows,
                     int64_t row_offset, int64_t value_offset, int64_t head_stride) {
  const int64_t tokens = qkv.size(0), dim = cos.size(1), kv_width = kv_heads * dim;
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) == (heads + 2 * kv_heads) * dim && dim % 2 == 0,
              "rope_and_cache_: qkv must be float32 [T, (Hq + 2 Hkv) D] with contiguous rows");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope_and_cache_: cos and sin must be contiguous float32 [P, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == tokens && slot_rows.scalar_type() == at::kLong &&
                  slot_rows.is_contiguous() && slot_rows.numel() == tokens,
              "rope_and_cache_: positions and slot_rows must be contiguous int64 [T]");
  TORCH_CHECK(cache_rows.scalar_type() == at::kFloat && cache_rows.dim() == 2 &&
                  cache_rows.is_contiguous() && cache_rows.size(1) == dim && head_stride >= 0,
              "rope_and_cache_: cache_rows must be the contiguous float32 [R, D] region");
  const int64_t last_head = (kv_heads - 1) * head_stride;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rope_and_cache_: position ", pos[t],
                " outside the RoPE table");
    const int64_t row = slots[t] + row_offset;
    TORCH_CHECK(row >= 0 && value_offset >= 0 &&
                    row + last_head + value_offset < cache_rows.size(0),
                "rope_and_cache_: a cache row is outside the region");
  }
  float* base = qkv.data_ptr<float>();
  float* cache = cache_rows.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t ld = qkv.stride(0);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = base + t * ld;
      const float* c = cp + pos[t] * dim;
      const float* s = sp + pos[t] * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) rotate(row + h * dim, c, s, dim);
      const float* k = row + heads * dim;
      const int64_t key_row = slots[t] + row_offset;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t head_row = key_row + h * head_stride;
        std::copy(k + h * dim, k + (h + 1) * dim, cache + head_row * dim);
        std::copy(k + kv_width + h * dim, k + kv_width + (h + 1) * dim,
                  cache + (head_row + value_offset) * dim);
      }
    }
  });
}

}  // namespace pdcluster

TORCH_LIBRARY_FRAGMENT(pdcluster, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rope_and_cache_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int heads, "
      "int kv_heads, Tensor(b!) cache_rows, Tensor slot_rows, int row_offset, "
      "int value_offset, int head_stride) -> ()");
}

TORCH_LIBRARY_IMPL(pdcluster, CPU, m) {
  m.impl("rms_norm", &pdcluster::rms_norm);
  m.impl("add_rms_norm_", &pdcluster::add_rms_norm_);
  m.impl("rope_and_cache_", &pdcluster::rope_and_cache_);
}
