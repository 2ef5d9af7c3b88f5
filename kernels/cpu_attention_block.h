// One cache block's share of CPU paged attention (cpu_attention.cpp): the online-softmax
// update, the dot products of query vectors with the block's keys, the probability-weighted sum
// of its values, and the prefetching of the next block's lines while this one is computed.
// Included by cpu_attention.cpp only; tests/kernels holds the whole kernel to the references.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_simd.h"

namespace tandem::attn {

// One block's online-softmax update for one query vector: s[0, n) holds its scores (-inf where
// masked); they become exp(s - new max) (0 where masked), m and l the running max and sum.
// Returns alpha = exp(old max - new max), the factor for the accumulator, or -1 when nothing in
// the block is visible (s is then all 0 and m, l unchanged). The scores are read in whole
// vectors of eight: s must have room up to the next multiple of 8 (`room`, its row stride),
// which this pads with -inf.
inline float softmax_block(float* s, int n, int room, float& m, float& l) {
#ifdef __AVX2__
  if (room % 8 == 0) {
    const int nv = (n + 7) & ~7;
    for (int j = n; j < nv; ++j) s[j] = -INFINITY;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 mv = _mm256_set1_ps(m);
    for (int j = 0; j < nv; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    const float mx = hmax8(mv);
    if (mx == -INFINITY) {
      for (int j = 0; j < nv; ++j) s[j] = 0.f;
      return -1.f;
    }
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < nv; j += 8) {
      const __m256 x = _mm256_loadu_ps(s + j);
      // exp_neg of -inf is not 0 (it clamps at -87): masked scores are zeroed explicitly.
      const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ),
                                        exp_neg8(_mm256_sub_ps(x, mxv)));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    const float alpha = exp_neg(m - mx);
    l = l * alpha + hsum8(sum);
    m = mx;
    return alpha;
  }
#endif
  (void)room;
  float mx = m;
  for (int j = 0; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
  if (mx == -INFINITY) {
    for (int j = 0; j < n; ++j) s[j] = 0.f;
    return -1.f;
  }
  const float alpha = exp_neg(m - mx);
  float sum = 0.f;
  for (int j = 0; j < n; ++j) {
    const float e = exp_neg(s[j] - mx);
    s[j] = s[j] == -INFINITY ? 0.f : e;
    sum += s[j];
  }
  l = l * alpha + sum;
  m = mx;
  return alpha;
}


#ifdef __AVX2__
// out[0, 8) = the lane sums of a0..a7: one horizontal tree for eight dot products, not eight.
inline void store_sums8(float* out, __m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4,
                        __m256 a5, __m256 a6, __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                      _mm256_permute2f128_ps(t0, t1, 0x31)));
}
#endif

// out[j] = q . k_j for the n keys at k + j * k_stride. With AVX2 and D a multiple of 8, eight
// keys at a time, reduced together (store_sums8).
template <int kD>
inline void score_keys(const float* q, int head_dim, const float* k, int64_t k_stride, int n,
                       float* out) {
  const int D = kD > 0 ? kD : head_dim;
  int j = 0;
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (; j + 8 <= n; j += 8) {
      const float* kj = k + j * k_stride;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
             a7 = a0;
      for (int d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + k_stride + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + 2 * k_stride + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + 3 * k_stride + d), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + 4 * k_stride + d), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + 5 * k_stride + d), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + 6 * k_stride + d), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + 7 * k_stride + d), a7);
      }
      store_sums8(out + j, a0, a1, a2, a3, a4, a5, a6, a7);
    }
  }
#endif
  for (; j < n; ++j) {
    const float* kr = k + j * k_stride;
    float a = 0.f;
#pragma omp simd reduction(+ : a)
    for (int d = 0; d < D; ++d) a += q[d] * kr[d];
    out[j] = a;
  }
}

// score_keys for two query vectors at once (q0 and q0 + D, two heads of one GQA group): each
// key vector is loaded once for both, which halves the loads and the key-address arithmetic of
// the score pass (the compiler spilled the eight key strides to the stack). Bit-equal to two
// score_keys calls; decode attention with every key in cache (cpu_attention.py --hot's shapes,
// two builds alternated in one process) 4.21 -> 3.97 ms median.
template <int kD>
inline void score_keys2(const float* q0, const float* k, int64_t k_stride, int n, float* out0,
                        float* out1) {
#ifdef __AVX2__
  if constexpr (kD > 0 && kD % 8 == 0) {
    const float* q1 = q0 + kD;
    int j = 0;
    for (; j + 8 <= n; j += 8) {
      const float* kj = k + j * k_stride;
      __m256 a[8], b[8];
      for (int i = 0; i < 8; ++i) a[i] = b[i] = _mm256_setzero_ps();
      for (int d = 0; d < kD; d += 8) {
        const __m256 x0 = _mm256_loadu_ps(q0 + d), x1 = _mm256_loadu_ps(q1 + d);
        for (int i = 0; i < 8; ++i) {
          const __m256 kv = _mm256_loadu_ps(kj + i * k_stride + d);
          a[i] = _mm256_fmadd_ps(x0, kv, a[i]);
          b[i] = _mm256_fmadd_ps(x1, kv, b[i]);
        }
      }
      store_sums8(out0 + j, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
      store_sums8(out1 + j, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]);
    }
    if (j < n) {
      score_keys<kD>(q0, kD, k + j * k_stride, k_stride, n - j, out0 + j);
      score_keys<kD>(q1, kD, k + j * k_stride, k_stride, n - j, out1 + j);
    }
    return;
  }
#endif
  score_keys<kD>(q0, kD, k, k_stride, n, out0);
  score_keys<kD>(q0 + kD, kD, k, k_stride, n, out1);
}

// acc[:D] += sum_j p[j] * v_j for the n value rows at v + j * v_stride. With D known at compile
// time the accumulator lives in registers for the whole block instead of memory.
template <int kD>
inline void accumulate_values(const float* p, const float* v, int64_t v_stride, int n,
                              float* __restrict acc, int head_dim, float alpha) {
#ifdef __AVX2__
  if constexpr (kD > 0 && kD % 8 == 0 && kD <= 64) {
    // Explicit registers: written as a float array, GCC kept the accumulator on the stack, so
    // each value row waited on the previous row's store (perf: a load-FMA-store chain per key).
    // Two chains (even and odd keys) hide the FMA latency; their sum is taken at the end. The
    // online softmax's rescaling by alpha is applied as the accumulator is loaded.
    constexpr int V = kD / 8;
    __m256 a[V], b[V];
    const __m256 al = _mm256_set1_ps(alpha);
    for (int i = 0; i < V; ++i) {
      a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * i), al);
      b[i] = _mm256_setzero_ps();
    }
    int j = 0;
    for (; j + 2 <= n; j += 2) {
      const __m256 p0 = _mm256_broadcast_ss(p + j), p1 = _mm256_broadcast_ss(p + j + 1);
      const float* v0 = v + j * v_stride;
      const float* v1 = v0 + v_stride;
      for (int i = 0; i < V; ++i) {
        a[i] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * i), a[i]);
        b[i] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + 8 * i), b[i]);
      }
    }
    if (j < n) {
      const __m256 p0 = _mm256_broadcast_ss(p + j);
      const float* v0 = v + j * v_stride;
      for (int i = 0; i < V; ++i) a[i] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * i), a[i]);
    }
    for (int i = 0; i < V; ++i) _mm256_storeu_ps(acc + 8 * i, _mm256_add_ps(a[i], b[i]));
    return;
  }
#endif
  if (alpha != 1.f)
    for (int d = 0; d < head_dim; ++d) acc[d] *= alpha;
  if constexpr (kD > 0 && kD <= 128) {
    float a[kD];
    for (int d = 0; d < kD; ++d) a[d] = acc[d];
    for (int j = 0; j < n; ++j) {
      const float pj = p[j];
      const float* vr = v + j * v_stride;
#pragma omp simd
      for (int d = 0; d < kD; ++d) a[d] += pj * vr[d];
    }
    for (int d = 0; d < kD; ++d) acc[d] = a[d];
  } else {
    for (int j = 0; j < n; ++j) {
      const float pj = p[j];
      const float* vr = v + j * v_stride;
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) acc[d] += pj * vr[d];
    }
  }
}

// Prefetch every 64-byte line of `rows` rows of `row_floats` floats, `stride` floats apart, into
// L2, not L1 (locality 2: prefetcht1): a block's 8 KiB of K and V pulled into the 32 KiB L1
// while the current block is computed evicted its working set (measured: 9-10 ms against 7.4 ms
// for decode attention over 90 MB; one block ahead did as well as two). A tile's first block,
// before there is compute to spread the requests over (later blocks: Prefetcher).
inline void prefetch_rows(const float* p, int rows, int64_t stride, int row_floats) {
  for (int r = 0; r < rows; ++r)
    for (int o = 0; o < row_floats; o += 16) __builtin_prefetch(p + r * stride + o, 0, 2);
}

// Prefetches `rows` rows of `row_floats` floats, `stride` floats apart, into L2 a few lines at a
// time (`issue`), so that the requests for the next block spread over this block's compute.
// Decode attention over 90 MB of scattered K/V (benchmarks/cpu_attention.py's shapes, 2 threads)
// took 5.4-7.2 ms with the next block's lines asked for row by row at the block's start, 9.3 ms
// asked for in one flat loop (a burst stalls the core while the requests queue), and 4.5-5.2 ms
// spread like this.
struct Prefetcher {
  // The lines still to ask for: [next, end) when the rows are one contiguous span (the usual
  // whole-row item: a block's K of every head for one layer is one run of memory), else row
  // by row. The flat walk costs a compare per line where the row walk cost a branchy update:
  // perf put 8.5 % of the kernel's samples in the row walk; decode attention over 90 MB went
  // 4.64 -> 4.19 ms median (3.84 -> 3.69 with every key in cache), two builds alternated.
  const char* next = nullptr;
  const char* end = nullptr;
  const float* p = nullptr;
  int64_t stride = 0;
  int rows = 0, row_floats = 0, r = 0, o = 0;
  void start(const float* base, int nrows, int64_t st, int rf) {
    if (st == rf) {
      next = reinterpret_cast<const char*>(base);
      end = next + static_cast<int64_t>(nrows) * st * 4;
      rows = 0;
      return;
    }
    next = end = nullptr;
    p = base;
    rows = nrows;
    stride = st;
    row_floats = rf;
    r = o = 0;
  }
  void stop() {
    next = end = nullptr;
    rows = 0;
  }
  void issue(int lines) {
    if (next < end) {
      const char* stop_at = next + static_cast<int64_t>(lines) * 64;
      if (stop_at > end) stop_at = end;
      for (; next < stop_at; next += 64) __builtin_prefetch(next, 0, 2);
      return;
    }
    for (; lines > 0 && r < rows; --lines) {
      __builtin_prefetch(p + r * stride + o, 0, 2);
      o += 16;
      if (o >= row_floats) {
        o = 0;
        ++r;
      }
    }
  }
};

}  // namespace tandem::attn
