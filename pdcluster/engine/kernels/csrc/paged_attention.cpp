// Decode attention that reads the paged KV cache in place (CPU, float32).
//
// torch.ops.pdcluster.paged_attention(q, k_cache, v_cache, block_table, context_lens, scale)
//   q            [S, Hkv, R, D]  contiguous: R query rows share each KV head (the GQA group of
//                                one sequence, or every sequence's group when S = 1 reads
//                                blocks all of them share: cascade attention)
//   k_cache      [NB, BS, Hkv, D] any strides with the last one 1: one layer's view of the
//                                block-contiguous region (engine/kv/kv_cache.py)
//   v_cache      [NB, BS, Hkv, Dv], Dv <= D, likewise (Dv < D: MLA's latent cache, whose
//                                entries are the keys and their first Dv dims the values)
//   block_table  [S, MB] int64, context_lens [S] int64 (tokens attended; 0 allowed)
//   -> (out [S, Hkv, R, Dv], lse [S, Hkv, R]): softmax(scale * q k^T) v and the natural-log
//      sum-exp of each row's scaled scores (-inf, out 0, for an empty context), which is what
//      merging two partial attentions over disjoint keys needs.
//
// One task per (sequence, KV head, chunk of rows): it walks the sequence's blocks once, scoring
// a block's keys against every row of the chunk (each key read once for the GQA group), and
// keeps a running max / sum / weighted value per row (online softmax). No gather, no padding.
// With fewer (sequence, KV head) pairs than threads (MLA's one latent head, at batch 1), the
// rows are cut into smaller chunks so that every thread takes a share; a row's arithmetic
// does not depend on its chunk.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 16;  // rows per task: enough to reuse a key, small enough for L1
constexpr int64_t kTile = 16;     // keys scored together: one transposed tile of the cache
constexpr int64_t kMaxDim = 576;  // DeepSeek's MLA: a 512-dim latent and a 64-dim RoPE key

// exp(x) for x <= 0 (scores minus their running max), branch-free so that it vectorizes:
// Cephes' expf (range reduction by ln 2, degree-5 polynomial, 2^n from the exponent bits);
// about 1 ulp. Below -87 (and for -inf, a padded key) it is 0, as such a weight must be.
inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.0f;
  x = std::max(x, -87.0f);
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float pow2;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  return underflow ? 0.f : y * pow2;
}

struct Cache {
  const float* data;
  int64_t block_stride, token_stride, head_stride;
  const float* at(int64_t block, int64_t token, int64_t head) const {
    return data + block * block_stride + token * token_stride + head * head_stride;
  }
};

// Per task: the rows' scaled queries, their running max / sum / weighted values, and the
// weights of one tile of keys.
struct RowState {
  float q[kMaxRows * kMaxDim];
  float acc[kMaxRows * kMaxDim];
  float p[kMaxRows * kTile];
  float m[kMaxRows], l[kMaxRows];
};

inline float dot(const float* a, const float* b, int64_t dim) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < dim; ++d) s += a[d] * b[d];
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on eight lanes (the same polynomial and constants).
inline __m256 exp8_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 fx = _mm256_floor_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                    _mm256_set1_ps(0.5f)));
  x = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f))),
                    _mm256_mul_ps(fx, _mm256_set1_ps(2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(underflow, out);
}

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

// Four dot products of `q` with four keys at once: four independent FMA chains, one
// horizontal reduction for all four.
inline __m128 dot4(const float* q, const float* const* keys, int64_t dim) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[0] + d), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[1] + d), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[2] + d), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[3] + d), a3);
  }
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

// Scores of every row against the tile's n keys (of `dim`), then the online-softmax update
// (of accumulators of `vdim`).
void score_tile(RowState& st, const float* const* keys, int64_t rows, int64_t dim, int64_t vdim,
                int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = st.q + r * dim;
    float s[kTile];
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (dim % 8 == 0)
      for (; t + 4 <= n; t += 4) _mm_storeu_ps(s + t, dot4(qr, keys + t, dim));
#endif
    for (; t < n; ++t) s[t] = dot(qr, keys[t], dim);
    for (; t < kTile; ++t) s[t] = -std::numeric_limits<float>::infinity();  // padding: p = 0
    float tile_max = s[0];
#pragma omp simd reduction(max : tile_max)
    for (t = 0; t < kTile; ++t) tile_max = std::max(tile_max, s[t]);
    const float m_new = std::max(st.m[r], tile_max);
    if (m_new > st.m[r]) {
      const float c = std::exp(st.m[r] - m_new);  // 0 on the first tile (m = -inf)
      st.l[r] *= c;
      float* acc = st.acc + r * vdim;
#pragma omp simd
      for (int64_t d = 0; d < vdim; ++d) acc[d] *= c;
      st.m[r] = m_new;
    }
    float* p = st.p + r * kTile;
    float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    static_assert(kTile == 16, "two vectors of eight");
    const __m256 m8 = _mm256_set1_ps(m_new);
    const __m256 p0 = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s), m8));
    const __m256 p1 = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + 8), m8));
    _mm256_storeu_ps(p, p0);
    _mm256_storeu_ps(p + 8, p1);
    sum = hsum(_mm256_add_ps(p0, p1));
#else
    for (t = 0; t < kTile; ++t) {
      p[t] = exp_nonpositive(s[t] - m_new);
      sum += p[t];
    }
#endif
    st.l[r] += sum;
  }
}

// acc[r] += sum_t p[r][t] * value_t over the tile's n values; with AVX2 a 64-wide slice of a
// row's accumulator stays in registers for the whole tile.
void accumulate_tile(RowState& st, const float* const* values, int64_t rows, int64_t dim,
                     int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = st.acc + r * dim;
    const float* p = st.p + r * kTile;
    int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d0 + 64 <= dim; d0 += 64) {
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(acc + d0 + 8 * j);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 w = _mm256_set1_ps(p[t]);
        const float* v = values[t] + d0;
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * j), a[j]);
      }
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + d0 + 8 * j, a[j]);
    }
#endif
    for (int64_t t = 0; t < n; ++t) {
      const float w = p[t];
      const float* v = values[t];
#pragma omp simd
      for (int64_t d = d0; d < dim; ++d) acc[d] += w * v[d];
    }
  }
}

// Asks for the next tile's keys and values while this one computes: blocks sit anywhere in
// the region, so the hardware prefetcher cannot guess the next one.
inline void prefetch_tile(const Cache& k, const Cache& v, const int64_t* table, int64_t begin,
                          int64_t end, int64_t block_size, int64_t head, int64_t dim,
                          int64_t vdim) {
  for (int64_t pos = begin; pos < end; ++pos) {
    const int64_t block = table[pos / block_size], slot = pos % block_size;
    const char* key = reinterpret_cast<const char*>(k.at(block, slot, head));
    const char* value = reinterpret_cast<const char*>(v.at(block, slot, head));
    for (int64_t off = 0; off < dim * 4; off += 64) __builtin_prefetch(key + off);
    if (value != key)
      for (int64_t off = 0; off < vdim * 4; off += 64) __builtin_prefetch(value + off);
  }
}

// Rows [r0, r1) of one sequence against KV head `head` over its `ctx` tokens.
void attend_rows(const float* q, const Cache& k, const Cache& v, const int64_t* table,
                 int64_t ctx, int64_t block_size, int64_t head, int64_t rows, int64_t dim,
                 int64_t vdim, float scale, float* out, float* lse) {
  thread_local RowState st;
  for (int64_t r = 0; r < rows; ++r) {
    st.m[r] = -std::numeric_limits<float>::infinity();
    st.l[r] = 0.f;
    for (int64_t d = 0; d < dim; ++d) st.q[r * dim + d] = q[r * dim + d] * scale;
    for (int64_t d = 0; d < vdim; ++d) st.acc[r * vdim + d] = 0.f;
  }
  const float* keys[kTile];
  const float* values[kTile];
  for (int64_t start = 0; start < ctx; start += kTile) {
    const int64_t n = std::min(kTile, ctx - start);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = start + t;
      const int64_t block = table[pos / block_size], slot = pos % block_size;
      keys[t] = k.at(block, slot, head);
      values[t] = v.at(block, slot, head);
    }
    prefetch_tile(k, v, table, start + kTile, std::min(ctx, start + 2 * kTile), block_size,
                  head, dim, vdim);
    score_tile(st, keys, rows, dim, vdim, n);
    accumulate_tile(st, values, rows, vdim, n);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = st.l[r] > 0.f ? 1.f / st.l[r] : 0.f;
    for (int64_t d = 0; d < vdim; ++d) out[r * vdim + d] = st.acc[r * vdim + d] * inv;
    lse[r] = st.l[r] > 0.f ? st.m[r] + std::log(st.l[r])
                           : -std::numeric_limits<float>::infinity();
  }
}

Cache as_cache(const at::Tensor& t) {
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}

}  // namespace

namespace pdcluster {

std::tuple<at::Tensor, at::Tensor> paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                   const at::Tensor& v_cache,
                                                   const at::Tensor& block_table,
                                                   const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 4 &&
                  q.is_contiguous(),
              "paged_attention: q must be a contiguous float32 CPU tensor [S, Hkv, R, D]");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                  k_cache.dim() == 4 && v_cache.dim() == 4 &&
                  k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3) &&
                  v_cache.size(3) <= k_cache.size(3) && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "paged_attention: k/v caches must be float32 [NB, BS, Hkv, D] and [NB, BS, Hkv, "
              "Dv <= D] with unit last stride");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 &&
                  block_table.is_contiguous() && context_lens.scalar_type() == at::kLong &&
                  context_lens.is_contiguous(),
              "paged_attention: block_table [S, MB] and context_lens [S] must be contiguous int64");
  const int64_t seqs = q.size(0), heads = q.size(1), rows = q.size(2), dim = q.size(3);
  const int64_t block_size = k_cache.size(1), vdim = v_cache.size(3);
  TORCH_CHECK(dim <= kMaxDim, "paged_attention: head_dim above ", kMaxDim, " is not supported");
  TORCH_CHECK(k_cache.size(2) == heads && k_cache.size(3) == dim && block_table.size(0) == seqs &&
                  context_lens.size(0) == seqs,
              "paged_attention: shapes of q, the caches and the tables disagree");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs; ++s)
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= block_table.size(1) * block_size,
                "paged_attention: a context is longer than its block table");
  auto out = at::empty({seqs, heads, rows, vdim}, q.options());
  auto lse = at::empty({seqs, heads, rows}, q.options());
  const Cache k = as_cache(k_cache), v = as_cache(v_cache);
  const int64_t pairs = std::max<int64_t>(1, seqs * heads);
  const int64_t shares = (at::get_num_threads() + pairs - 1) / pairs;  // chunks a pair wants
  const int64_t chunk_rows =
      std::max<int64_t>(1, std::min(kMaxRows, (rows + shares - 1) / shares));
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const int64_t* tp = block_table.data_ptr<int64_t>();
  const int64_t table_width = block_table.size(1);
  at::parallel_for(0, seqs * heads * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / (heads * chunks), h = (task / chunks) % heads;
      const int64_t r0 = (task % chunks) * chunk_rows, r1 = std::min(rows, r0 + chunk_rows);
      const int64_t row = (s * heads + h) * rows + r0;
      attend_rows(qp + row * dim, k, v, tp + s * table_width, lens[s], block_size, h, r1 - r0,
                  dim, vdim, static_cast<float>(scale), op + row * vdim, lp + row);
    }
  });
  return {out, lse};
}

}  // namespace pdcluster

TORCH_LIBRARY_FRAGMENT(pdcluster, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor context_lens, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdcluster, CPU, m) { m.impl("paged_attention", &pdcluster::paged_attention); }
