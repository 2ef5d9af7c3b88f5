// Tandem's CPU kernels (float32): the KV write, RMSNorm with the residual add, SiLU-and-mul, the
// rotary embedding and the sampler's argmax; paged attention is cpu_attention.cpp's, the few-row
// linear layer cpu_linear.cpp's.
//
// Built at first use by tandem/kernels/cpu_build.py (g++ -O3 -fopenmp, cached per source, compiler
// and CPU) into one library with cpu_attention.cpp, cpu_linear.cpp and cpu_forward.cpp (the fused
// decoder forward, which calls these), and called through ctypes by tandem/kernels/cpu_ops.py,
// whose checked wrappers are the only callers. Each function is held by tests/kernels to its
// PyTorch reference in tandem/kernels/refs.py. Plain C ABI, raw pointers and element strides: no torch headers, so a
// build takes a second or two instead of the minute a torch extension needs.
//
// OpenMP: torch's own libgomp is already loaded when this library is, so both share one runtime
// and one thread pool; callers pass torch.get_num_threads().

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"

using namespace tandem;

extern "C" {

int tandem_cpu_abi_version() { return 4; }

// Write k[t], v[t] ([T, H, D], strides in elements) to slot slot_mapping[t] of the caches
// ([blocks, block_size, H, D]); slot < 0 is padding and is skipped. Returns 0, or 1 + the first
// token whose slot is beyond num_slots (then nothing is written).
int tandem_kv_cache_write_f32(const float* k, const float* v, int64_t k_st, int64_t k_sh,
                               int64_t v_st, int64_t v_sh, float* k_cache, float* v_cache,
                               int64_t kc_b, int64_t kc_s, int64_t kc_h, int64_t vc_b,
                               int64_t vc_s, int64_t vc_h, const int64_t* slots,
                               int64_t num_slots, int num_tokens, int num_heads, int head_dim,
                               int block_size, int num_threads) {
  for (int t = 0; t < num_tokens; ++t)
    if (slots[t] >= num_slots) return 1 + t;
#pragma omp parallel for num_threads(num_threads) if (num_tokens > 64) schedule(static)
  for (int t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t b = slot / block_size, o = slot % block_size;
    for (int h = 0; h < num_heads; ++h) {
      std::memcpy(k_cache + b * kc_b + o * kc_s + h * kc_h, k + t * k_st + h * k_sh,
                  sizeof(float) * head_dim);
      std::memcpy(v_cache + b * vc_b + o * vc_s + h * vc_h, v + t * v_st + h * v_sh,
                  sizeof(float) * head_dim);
    }
  }
  return 0;
}

// RMSNorm of x [T, H] (row stride x_st), or of x + residual, times weight [H]. With a residual
// the sum is written to residual_out (may alias residual). out may not alias x.
void tandem_rms_norm_f32(const float* x, int64_t x_st, const float* residual, int64_t r_st,
                         const float* weight, float eps, float* out, int64_t o_st,
                         float* residual_out, int64_t ro_st, int num_tokens, int hidden,
                         int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_tokens > 16) schedule(static)
  for (int t = 0; t < num_tokens; ++t) {
    const float* xr = x + t * x_st;
    float* o = out + t * o_st;
    const float* src = xr;
    if (residual) {
      const float* rr = residual + t * r_st;
      float* ro = residual_out + t * ro_st;
      for (int i = 0; i < hidden; ++i) ro[i] = xr[i] + rr[i];
      src = ro;
    }
    const float ss = dot(src, src, hidden);
    const float rstd = 1.f / std::sqrt(ss / hidden + eps);
#pragma omp simd
    for (int i = 0; i < hidden; ++i) o[i] = src[i] * rstd * weight[i];
  }
}

// out [T, I] = silu(x[:, :I]) * x[:, I:] for x [T, 2I] (row strides in elements).
void tandem_silu_and_mul_f32(const float* x, int64_t x_st, float* out, int64_t o_st,
                             int num_tokens, int inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_tokens > 4) schedule(static)
  for (int t = 0; t < num_tokens; ++t) {
    const float* a = x + t * x_st;
    const float* b = a + inter;
    float* o = out + t * o_st;
    int i = 0;
#ifdef __AVX2__
    // sigmoid(a) from e = exp(-|a|) <= 1 (exp_neg's domain): 1 / (1 + e) for a >= 0, else
    // e / (1 + e). Eight at a time: glibc's expf is a scalar call per element.
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; i + 8 <= inter; i += 8) {
      const __m256 av = _mm256_loadu_ps(a + i);
      const __m256 e = exp_neg8(_mm256_or_ps(av, sign));  // -|a|
      const __m256 num = _mm256_blendv_ps(one, e, av);  // the sign bit of a picks e
      const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(av, sig), _mm256_loadu_ps(b + i)));
    }
#endif
    for (; i < inter; ++i) o[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
  }
}

// Neox-style rotary embedding in place on q [T, Hq, D] and k [T, Hk, D] (strides in elements)
// over the first rot_dim dims, cos_sin [max_pos, rot_dim] (cos then sin), positions [T].
// Returns 0, or 1 + the first token whose position is outside [0, max_pos) (nothing rotated).
int tandem_rotary_f32(const int64_t* positions, float* q, int64_t q_st, int64_t q_sh, float* k,
                      int64_t k_st, int64_t k_sh, const float* cos_sin, int64_t max_pos,
                      int rot_dim, int num_tokens, int num_q_heads, int num_k_heads,
                      int num_threads) {
  for (int t = 0; t < num_tokens; ++t)
    if (positions[t] < 0 || positions[t] >= max_pos) return 1 + t;
  const int half = rot_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (num_tokens > 16) schedule(static)
  for (int t = 0; t < num_tokens; ++t) {
    const float* cs = cos_sin + positions[t] * rot_dim;
    const float* c = cs;
    const float* s = cs + half;
    for (int which = 0; which < 2; ++which) {
      float* base = which == 0 ? q + t * q_st : k + t * k_st;
      const int heads = which == 0 ? num_q_heads : num_k_heads;
      const int64_t sh = which == 0 ? q_sh : k_sh;
      for (int h = 0; h < heads; ++h) {
        float* x1 = base + h * sh;
        float* x2 = x1 + half;
#pragma omp simd
        for (int i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  }
  return 0;
}

// out[r] = the index of the largest of x[r, 0..cols) (row stride x_st in elements): the first
// one where several are equal, the first NaN where there is one (torch.argmax's rule). Two
// passes over a row in cache: its maximum (eight lanes), then its first index. torch's argmax
// read the sampler's logits at ~1 G elements/s (0.5 ms for 128 rows of 4096 on two threads).
void tandem_argmax_f32(const float* x, int64_t x_st, int rows, int cols, int64_t* out,
                       int num_threads) {
  const int64_t work = static_cast<int64_t>(rows) * cols;
#pragma omp parallel for num_threads(num_threads) if (work > (1 << 16)) schedule(static)
  for (int r = 0; r < rows; ++r) {
    const float* row = x + r * x_st;
    int c = 0;
    float best = -INFINITY;
    bool nan = false;
#ifdef __AVX2__
    __m256 mv = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    for (; c + 8 <= cols; c += 8) {
      const __m256 v = _mm256_loadu_ps(row + c);
      un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      mv = _mm256_max_ps(mv, v);
    }
    nan = _mm256_movemask_ps(un) != 0;
    best = hmax8(mv);
#endif
    for (; c < cols; ++c) {
      nan = nan || std::isnan(row[c]);
      best = row[c] > best ? row[c] : best;
    }
    int j = 0;
    int64_t idx = -1;
#ifdef __AVX2__
    const __m256 bv = _mm256_set1_ps(best);
    for (; j + 8 <= cols && idx < 0; j += 8) {
      const __m256 v = _mm256_loadu_ps(row + j);
      const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                             : _mm256_cmp_ps(v, bv, _CMP_EQ_OQ));
      if (hit) idx = j + __builtin_ctz(hit);
    }
#endif
    for (; j < cols && idx < 0; ++j)
      if (nan ? std::isnan(row[j]) : row[j] == best) idx = j;
    out[r] = idx < 0 ? 0 : idx;
  }
}

}  // extern "C"
