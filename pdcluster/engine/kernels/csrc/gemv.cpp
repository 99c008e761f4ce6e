// Batch-1 projections (CPU, float32): one token's activations times a weight matrix, which
// is what every linear of a batch-1 decode step is. The step streams every weight once, so
// the kernel's whole job is to read W at the memory's rate: rows are split across threads,
// four rows at a time share each load of x, and x itself stays in L1.
//
// torch.ops.pdcluster.gemv(x [K] or [1, K], w [N, K] rows contiguous, bias [N]?) -> [.., N]
// torch.ops.pdcluster.gemv_swiglu(x, w [2I, K], bias [2I]?, I) -> silu(x w[:I]^T) * (x w[I:]^T)
//   (SwiGLU's gate and up halves of the fused weight, multiplied as they are computed)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGrain = 32;  // rows per parallel chunk: ~74 KB of a 576-wide weight

inline float dot_scalar(const float* w, const float* x, int64_t k) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < k; ++i) s += w[i] * x[i];
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}
#endif

// out[r - begin] = dot(w row r, x) for rows [begin, end) of a matrix with row stride `ld`.
void rows_dot(const float* w, int64_t ld, const float* x, int64_t k, int64_t begin, int64_t end,
              float* out) {
  int64_t r = begin;
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t k8 = k - k % 8;
  for (; r + 4 <= end; r += 4) {
    const float* w0 = w + r * ld;
    const float* w1 = w0 + ld;
    const float* w2 = w1 + ld;
    const float* w3 = w2 + ld;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < k8; i += 8) {
      const __m256 xv = _mm256_loadu_ps(x + i);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xv, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xv, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xv, a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xv, a3);
    }
    float* o = out + (r - begin);
    o[0] = hsum(a0) + dot_scalar(w0 + k8, x + k8, k - k8);
    o[1] = hsum(a1) + dot_scalar(w1 + k8, x + k8, k - k8);
    o[2] = hsum(a2) + dot_scalar(w2 + k8, x + k8, k - k8);
    o[3] = hsum(a3) + dot_scalar(w3 + k8, x + k8, k - k8);
  }
#endif
  for (; r < end; ++r) out[r - begin] = dot_scalar(w + r * ld, x, k);
}

void check(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
           int64_t rows) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.numel() == x.size(-1) && x.dim() >= 1,
              "gemv: x must be one contiguous float32 CPU row ([K] or [1, K])");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.stride(1) == 1 &&
                  w.size(1) == x.size(-1) && w.size(0) == rows,
              "gemv: w must be float32 [N, K] with contiguous rows and K = x's width");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == rows,
                "gemv: bias must be a contiguous float32 [N]");
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  auto shape = x.sizes().vec();
  shape.back() = n;
  return shape;
}

}  // namespace

namespace pdcluster {

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const int64_t n = w.size(0), k = w.size(1);
  check(x, w, bias, n);
  auto out = at::empty(out_shape(x, n), x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    rows_dot(wp, w.stride(0), xp, k, begin, end, op + begin);
    if (bp != nullptr)
      for (int64_t r = begin; r < end; ++r) op[r] += bp[r];
  });
  return out;
}

at::Tensor gemv_swiglu(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias, int64_t intermediate) {
  const int64_t k = w.size(1);
  check(x, w, bias, 2 * intermediate);
  auto out = at::empty(out_shape(x, intermediate), x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t ld = w.stride(0);
  at::parallel_for(0, intermediate, kGrain, [&](int64_t begin, int64_t end) {
    float up[kGrain * 4];
    for (int64_t start = begin; start < end; start += kGrain * 4) {
      const int64_t stop = std::min(end, start + kGrain * 4);
      rows_dot(wp, ld, xp, k, start, stop, op + start);                // gate rows
      rows_dot(wp + intermediate * ld, ld, xp, k, start, stop, up);  // up rows
      for (int64_t r = start; r < stop; ++r) {
        float g = op[r], u = up[r - start];
        if (bp != nullptr) {
          g += bp[r];
          u += bp[intermediate + r];
        }
        op[r] = g / (1.f + std::exp(-g)) * u;  // silu(g) * u, as torch computes silu
      }
    }
  });
  return out;
}

}  // namespace pdcluster

TORCH_LIBRARY_FRAGMENT(pdcluster, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("gemv_swiglu(Tensor x, Tensor w, Tensor? bias, int intermediate) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdcluster, CPU, m) {
  m.impl("gemv", &pdcluster::gemv);
  m.impl("gemv_swiglu", &pdcluster::gemv_swiglu);
}
