// The linear layer for a few token rows: C[T, N] = A[T, K] @ W[N, K]^T (+ bias), float32.
//
// Why not the BLAS: at the 1-4 rows of a single stream or a small decode batch, every weight is
// read once per step and the product is bound by how fast the weights stream in. MKL's sgemm
// called at one row (as the fused forward did) reads them at 6-16 GB/s on this VM's two cores
// against ~30 GB/s here: 15 MB of weights, 1.6 ms against 0.5 ms per step. Through F.linear
// (which takes MKL's gemv at one row) this kernel is 1.07-1.16x faster at one row and 1.4-2.8x
// at two or three; from ~6 rows MKL's register blocking wins, so callers switch to it above
// cpu_ops.LINEAR_MAX_ROWS.
//
// Called by cpu_forward.cpp (the fused forward's projections) and by the checked wrapper
// cpu_ops.cpu_linear (the eager CPU path's projections and the logits); tests/kernels holds it to
// refs.linear_ref. The sum over K runs in eight FMA lanes, then a fixed tree: a different but
// fixed rounding order from the BLAS's, as every kernel here has.

#include <algorithm>
#include <cstdint>

#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

namespace {

constexpr int kOut = 4;  // output features per work item: four weight rows streamed together
constexpr int64_t kSerialWork = 1 << 16;  // multiply-adds below which one thread is faster

// Outputs [o0, o0 + m) of every row, m <= kOut; w points at weight row o0.
void tile(const float* a, int64_t a_st, const float* w, const float* bias, int k, int m,
          float* c, int64_t c_st, int rows) {
  // A short tile reads weight row 0 in place of the missing rows and drops their results, so
  // the vector loop needs no second form.
  const float* wr[kOut];
  for (int i = 0; i < kOut; ++i) wr[i] = w + static_cast<int64_t>(i < m ? i : 0) * k;
  for (int r = 0; r < rows; ++r) {
    const float* x = a + r * a_st;
    float out[kOut] = {0.f, 0.f, 0.f, 0.f};
    int d = 0;
#ifdef __AVX2__
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (; d + 8 <= k; d += 8) {
      const __m256 xv = _mm256_loadu_ps(x + d);
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(wr[0] + d), xv, acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(wr[1] + d), xv, acc1);
      acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(wr[2] + d), xv, acc2);
      acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(wr[3] + d), xv, acc3);
    }
    // One horizontal tree for the four sums: lane i of the result is sum(acc_i).
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc0, acc1), _mm256_hadd_ps(acc2, acc3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
#endif
    for (int i = 0; i < m; ++i) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int e = d; e < k; ++e) sum += wr[i][e] * x[e];
      c[r * c_st + i] = out[i] + sum + (bias ? bias[i] : 0.f);
    }
  }
}

}  // namespace

extern "C" {

void tandem_linear_f32(const float* a, int64_t a_st, const float* w, const float* bias, float* c,
                       int64_t c_st, int num_tokens, int n, int k, int num_threads) {
  const int items = (n + kOut - 1) / kOut;
  const int64_t work = static_cast<int64_t>(num_tokens) * n * k;
  const int nt = work < kSerialWork ? 1 : std::max(1, num_threads);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int b = 0; b < items; ++b) {
    const int o0 = b * kOut;
    tile(a, a_st, w + static_cast<int64_t>(o0) * k, bias ? bias + o0 : nullptr, k,
         std::min(kOut, n - o0), c + o0, c_st, num_tokens);
  }
}

}  // extern "C"
