// Tandem's CPU kernels (float32): paged attention read straight from the block table, the KV
// write, RMSNorm with the residual add, SiLU-and-mul and the rotary embedding.
//
// Built at first use by tandem/kernels/cpu_build.py (g++ -O3 -fopenmp, cached per source, compiler
// and CPU) together with cpu_forward.cpp (the fused decoder forward, which calls these), and called
// through ctypes by tandem/kernels/cpu_ops.py, whose checked wrappers are the only callers. Each function is held by tests/kernels to its PyTorch reference in
// tandem/kernels/refs.py. Plain C ABI, raw pointers and element strides: no torch headers, so a
// build takes a second or two instead of the minute a torch extension needs.
//
// OpenMP: torch's own libgomp is already loaded when this library is, so both share one runtime
// and one thread pool; callers pass torch.get_num_threads().

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu_kernels.h"

namespace {

constexpr int kQueryTile = 16;  // query rows of one sequence handled together (extend)
constexpr int kKeyChunk = 32;   // keys scored before each online-softmax update

inline float dot(const float* a, const float* b, int n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline int64_t cache_offset(const int32_t* bt_row, int64_t pos, int block_size, int64_t s_b,
                            int64_t s_s) {
  return static_cast<int64_t>(bt_row[pos / block_size]) * s_b + (pos % block_size) * s_s;
}

// One work item: query rows [r0, r1) of one sequence (absolute positions ctx + r) for the
// `group` query heads that share KV head kvh.
struct Item {
  int seq, kvh, r0, r1;
};

}  // namespace

extern "C" {

int tandem_cpu_abi_version() { return 3; }

// 0, or 1 + the first sequence whose attention metadata would read outside the cache or out of
// order (see tandem_paged_attention_f32).
int tandem_check_attention_meta(const int32_t* block_tables, int64_t bt_stride, int max_blocks,
                                int num_blocks, const int32_t* qsl, const int32_t* seq_lens,
                                int num_seqs, int num_tokens, int block_size) {
  for (int s = 0; s < num_seqs; ++s) {
    const int lo = qsl ? qsl[s] : s, hi = qsl ? qsl[s + 1] : s + 1;
    const int64_t len = seq_lens[s];
    if (lo < 0 || hi < lo || hi > num_tokens) return 1 + s;
    if (len < 0 || (len > 0 && hi - lo > len) || len > static_cast<int64_t>(max_blocks) * block_size)
      return 1 + s;
    const int32_t* row = block_tables + s * bt_stride;
    for (int64_t b = 0, nb = (len + block_size - 1) / block_size; b < nb; ++b)
      if (row[b] < 0 || row[b] >= num_blocks) return 1 + s;
  }
  return 0;
}


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

// Causal attention over the paged cache for packed query rows.
//   q, out: [T, Hq, D]; sequence i owns rows qsl[i]..qsl[i+1] (qsl == nullptr: row i is
//   sequence i's only query, i.e. decode), at positions seq_lens[i] - qlen .. seq_lens[i] - 1.
//   Row at position p attends to keys j <= p, and with window > 0 only to p - j < window.
//   Rows of no sequence (t >= qsl[num_seqs]) and sequences of length 0 come back zero.
// Online softmax in fp32, exp via expf; GQA reads each KV head once for its `group` query heads.
// Returns 0, or (nothing read or written) 1 + the first sequence whose metadata is inconsistent:
// query rows not increasing or beyond num_tokens, more rows than seq_len, seq_len beyond its
// block-table row (max_blocks entries), or a block id outside [0, num_blocks).
int tandem_paged_attention_f32(const float* q, int64_t q_st, int64_t q_sh, const float* k_cache,
                                const float* v_cache, int64_t kc_b, int64_t kc_s, int64_t kc_h,
                                int64_t vc_b, int64_t vc_s, int64_t vc_h,
                                const int32_t* block_tables, int64_t bt_stride, int max_blocks,
                                int num_blocks, const int32_t* qsl, const int32_t* seq_lens,
                                int num_seqs, int num_tokens, int num_heads, int num_kv_heads,
                                int head_dim, int block_size, float scale, int window, float* out,
                                int64_t o_st, int64_t o_sh, int num_threads) {
  const int bad = tandem_check_attention_meta(block_tables, bt_stride, max_blocks, num_blocks,
                                              qsl, seq_lens, num_seqs, num_tokens, block_size);
  if (bad) return bad;
  const int group = num_heads / num_kv_heads;
  const int D = head_dim;
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(num_seqs) * num_kv_heads);
  int covered = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int lo = qsl ? qsl[s] : s, hi = qsl ? qsl[s + 1] : s + 1;
    covered = hi > covered ? hi : covered;
    if (seq_lens[s] <= 0) {
      for (int t = lo; t < hi; ++t)
        for (int h = 0; h < num_heads; ++h) std::memset(out + t * o_st + h * o_sh, 0, 4 * D);
      continue;
    }
    for (int r = lo; r < hi; r += kQueryTile)
      for (int h = 0; h < num_kv_heads; ++h)
        items.push_back({s, h, r, r + kQueryTile < hi ? r + kQueryTile : hi});
  }
  for (int t = covered; t < num_tokens; ++t)
    for (int h = 0; h < num_heads; ++h) std::memset(out + t * o_st + h * o_sh, 0, 4 * D);

  const int n_items = static_cast<int>(items.size());
#pragma omp parallel num_threads(num_threads) if (n_items > 1)
  {
    const int max_m = kQueryTile * group;
    std::vector<float> qbuf(static_cast<size_t>(max_m) * D), acc(static_cast<size_t>(max_m) * D);
    std::vector<float> m_i(max_m), l_i(max_m), sc(static_cast<size_t>(max_m) * kKeyChunk);
    std::vector<int64_t> pos(max_m);
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n_items; ++it) {
      const Item w = items[it];
      const int seq_len = seq_lens[w.seq];
      const int lo = qsl ? qsl[w.seq] : w.seq, hi = qsl ? qsl[w.seq + 1] : w.seq + 1;
      const int ctx = seq_len - (hi - lo);
      const int M = (w.r1 - w.r0) * group;
      const int32_t* bt = block_tables + w.seq * bt_stride;
      for (int r = w.r0; r < w.r1; ++r)
        for (int g = 0; g < group; ++g) {
          const int m = (r - w.r0) * group + g;
          const float* src = q + r * q_st + (w.kvh * group + g) * q_sh;
          for (int d = 0; d < D; ++d) qbuf[m * D + d] = src[d] * scale;
          pos[m] = ctx + (r - lo);
          m_i[m] = -INFINITY;
          l_i[m] = 0.f;
        }
      std::fill(acc.begin(), acc.begin() + static_cast<size_t>(M) * D, 0.f);
      const int64_t last = pos[M - 1];  // rows are in increasing position order
      int64_t first = 0;
      if (window > 0) first = pos[0] - window + 1 > 0 ? pos[0] - window + 1 : 0;
      for (int64_t j0 = first; j0 <= last; j0 += kKeyChunk) {
        const int n = static_cast<int>(last + 1 - j0 < kKeyChunk ? last + 1 - j0 : kKeyChunk);
        for (int j = 0; j < n; ++j) {
          const int64_t kp = j0 + j;
          const float* kr = k_cache + cache_offset(bt, kp, block_size, kc_b, kc_s) + w.kvh * kc_h;
          for (int m = 0; m < M; ++m) {
            const bool ok = kp <= pos[m] && (window <= 0 || pos[m] - kp < window);
            sc[m * kKeyChunk + j] = ok ? dot(qbuf.data() + m * D, kr, D) : -INFINITY;
          }
        }
        for (int m = 0; m < M; ++m) {
          float* s = sc.data() + m * kKeyChunk;
          float mx = m_i[m];
          for (int j = 0; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
          if (mx == -INFINITY) {  // nothing visible in this chunk for this row
            for (int j = 0; j < n; ++j) s[j] = 0.f;
            continue;
          }
          const float alpha = std::exp(m_i[m] - mx);
          float l = l_i[m] * alpha;
          for (int j = 0; j < n; ++j) {
            s[j] = s[j] == -INFINITY ? 0.f : std::exp(s[j] - mx);
            l += s[j];
          }
          m_i[m] = mx;
          l_i[m] = l;
          float* a = acc.data() + m * D;
          if (alpha != 1.f)
            for (int d = 0; d < D; ++d) a[d] *= alpha;
        }
        for (int j = 0; j < n; ++j) {
          const int64_t kp = j0 + j;
          const float* vr = v_cache + cache_offset(bt, kp, block_size, vc_b, vc_s) + w.kvh * vc_h;
          for (int m = 0; m < M; ++m) {
            const float p = sc[m * kKeyChunk + j];
            if (p == 0.f) continue;
            float* a = acc.data() + m * D;
#pragma omp simd
            for (int d = 0; d < D; ++d) a[d] += p * vr[d];
          }
        }
      }
      for (int r = w.r0; r < w.r1; ++r)
        for (int g = 0; g < group; ++g) {
          const int m = (r - w.r0) * group + g;
          float* dst = out + r * o_st + (w.kvh * group + g) * o_sh;
          const float inv = l_i[m] > 0.f ? 1.f / l_i[m] : 0.f;
          for (int d = 0; d < D; ++d) dst[d] = acc[m * D + d] * inv;
        }
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
    for (int i = 0; i < inter; ++i) o[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
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

}  // extern "C"
