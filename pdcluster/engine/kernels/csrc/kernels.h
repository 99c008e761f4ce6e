// The kernels one source file may call from another (decode_step.cpp runs a whole layer stack
// through them without a trip back to Python). Each is also registered as torch.ops.pdcluster.*
// by the file that defines it; see that file for what it computes.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace pdcluster {

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor gemv_swiglu(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias, int64_t intermediate);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   double eps);
void rope_and_cache_(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                     const at::Tensor& cache_rows, const at::Tensor& slot_rows,
                     int64_t row_offset, int64_t value_offset, int64_t head_stride);
std::tuple<at::Tensor, at::Tensor> paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                   const at::Tensor& v_cache,
                                                   const at::Tensor& block_table,
                                                   const at::Tensor& context_lens, double scale);

}  // namespace pdcluster
