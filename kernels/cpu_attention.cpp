// Paged attention on CPU (float32), read straight from the block table: decode rows and packed
// extend rows over the cached prefix, online softmax, GQA, sliding windows.
//
// Part of the library cpu_build.py builds from cpu_kernels.cpp (see there for how it is built,
// loaded and called); its checked wrapper is cpu_ops.cpu_paged_attention, held by tests/kernels
// to refs.paged_decode_attention_ref and refs.paged_extend_attention_ref, and the fused forward
// (cpu_forward.cpp) calls it once per layer.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"

namespace {

using namespace tandem;

constexpr int kQueryTile = 16;  // query rows of one sequence handled together (extend)

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

// One work item: query rows [r0, r1) of one sequence (absolute positions ctx + r) for the query
// heads of KV heads [h0, h1). All KV heads at once when there are enough items to go round the
// threads: a position's K (and V) row of every head is then one contiguous read.
struct Item {
  int seq, h0, h1, r0, r1;
};

// out[j] = q . k_j for the n keys at k + j * k_stride. With AVX2 and D a multiple of 8, eight
// keys at a time, reduced together (one horizontal tree for eight dot products, not eight).
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
      const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
      const __m256 lo = _mm256_permute2f128_ps(t0, t1, 0x20);
      const __m256 hi = _mm256_permute2f128_ps(t0, t1, 0x31);
      _mm256_storeu_ps(out + j, _mm256_add_ps(lo, hi));
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
  const float* p = nullptr;
  int64_t stride = 0;
  int rows = 0, row_floats = 0, r = 0, o = 0;
  void start(const float* base, int nrows, int64_t st, int rf) {
    p = base;
    rows = nrows;
    stride = st;
    row_floats = rf;
    r = o = 0;
  }
  void issue(int lines) {
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

struct AttnTile {
  const float* q;
  int64_t q_st, q_sh;
  float scale;
  int group, head_dim;
  Item w;
  int64_t pos_offset;  // row r sits at position r + pos_offset
};

// Online-softmax attention of one tile's M = rows x group query vectors over its keys, one cache
// block at a time (no per-key division); leaves the unnormalised output in acc and the running
// max / denominator in m_i / l_i. D is a template parameter for the common head dims so the dot
// products and the value accumulation unroll fully.
template <int kD>
void attend_tile_d(const AttnTile& t, const float* kc, const float* vc, int64_t kc_b,
                   int64_t kc_s, int64_t kc_h, int64_t vc_b, int64_t vc_s, int64_t vc_h,
                   const int32_t* bt, int bs,
                   int window, float* qbuf, float* acc, float* m_i, float* l_i, float* sc,
                   int64_t* pos, float* alpha) {
  const int D = kD > 0 ? kD : t.head_dim;
  const int Mh = (t.w.r1 - t.w.r0) * t.group;  // query vectors per KV head
  const int nh = t.w.h1 - t.w.h0;
  const int M = Mh * nh;
  for (int h = 0; h < nh; ++h)
    for (int r = t.w.r0; r < t.w.r1; ++r)
      for (int g = 0; g < t.group; ++g) {
        const int m = h * Mh + (r - t.w.r0) * t.group + g;
        const float* src = t.q + r * t.q_st + ((t.w.h0 + h) * t.group + g) * t.q_sh;
        for (int d = 0; d < D; ++d) qbuf[m * D + d] = src[d] * t.scale;
        pos[m] = r + t.pos_offset;
        m_i[m] = -INFINITY;
        l_i[m] = 0.f;
      }
  std::fill(acc, acc + static_cast<size_t>(M) * D, 0.f);
  const int64_t last = pos[Mh - 1], first_row = pos[0];  // rows in increasing position order
  const int64_t first = window > 0 && first_row - window + 1 > 0 ? first_row - window + 1 : 0;
  // Keys every row sees: [lo_all, hi_all]; outside it, per-row masks apply.
  const int64_t hi_all = first_row;
  const int64_t lo_all = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
  // The floats of one position's K (V) rows for heads [h0, h1): contiguous in the usual
  // [block, slot, head, dim] layout.
  const int row_floats_k = static_cast<int>((nh - 1) * kc_h + D);
  const int row_floats_v = static_cast<int>((nh - 1) * vc_h + D);
  {
    const int64_t b = first / bs;
    prefetch_rows(kc + static_cast<int64_t>(bt[b]) * kc_b + t.w.h0 * kc_h, bs, kc_s, row_floats_k);
    prefetch_rows(vc + static_cast<int64_t>(bt[b]) * vc_b + t.w.h0 * vc_h, bs, vc_s, row_floats_v);
  }
  const int lines_k = bs * ((row_floats_k + 15) / 16), lines_v = bs * ((row_floats_v + 15) / 16);
  const int calls = nh * Mh;  // score (and value) calls per block, each followed by a few lines
  const int per_k = (lines_k + calls - 1) / calls, per_v = (lines_v + calls - 1) / calls;
  Prefetcher pk, pv;
  for (int64_t b = first / bs; b <= last / bs; ++b) {
    const int64_t j0 = b * bs > first ? b * bs : first;
    const int64_t j1 = (b + 1) * bs - 1 < last ? (b + 1) * bs - 1 : last;  // inclusive
    const int n = static_cast<int>(j1 - j0 + 1);
    const float* kb0 = kc + static_cast<int64_t>(bt[b]) * kc_b + (j0 - b * bs) * kc_s;
    const float* vb0 = vc + static_cast<int64_t>(bt[b]) * vc_b + (j0 - b * bs) * vc_s;
    if (b < last / bs) {
      // Blocks are scattered, so the hardware prefetcher cannot guess the next one: its K and
      // V lines are asked for while this block is computed, a few after each score and value
      // call of this block.
      pk.start(kc + static_cast<int64_t>(bt[b + 1]) * kc_b + t.w.h0 * kc_h, bs, kc_s,
               row_floats_k);
      pv.start(vc + static_cast<int64_t>(bt[b + 1]) * vc_b + t.w.h0 * vc_h, bs, vc_s,
               row_floats_v);
    } else {
      pk.rows = pv.rows = 0;
    }
    for (int h = 0; h < nh; ++h) {
    const float* kb = kb0 + (t.w.h0 + h) * kc_h;
    const float* vb = vb0 + (t.w.h0 + h) * vc_h;
    float* sch = sc + static_cast<int64_t>(h) * Mh * bs;
    const int mb = h * Mh;
    for (int i = 0; i < Mh; ++i) {
      score_keys<kD>(qbuf + (mb + i) * D, D, kb, kc_s, n, sch + i * bs);
      pk.issue(per_k);
    }
    if (j1 > hi_all || j0 < lo_all) {
      for (int i = 0; i < Mh; ++i) {
        const int64_t hi_m = pos[i], lo_m = window > 0 ? pos[i] - window + 1 : 0;
        for (int j = 0; j < n; ++j)
          if (j0 + j > hi_m || j0 + j < lo_m) sch[i * bs + j] = -INFINITY;
      }
    }
    for (int i = 0; i < Mh; ++i) {
      const int m = mb + i;
      alpha[i] = softmax_block(sch + i * bs, n, bs, m_i[m], l_i[m]);
    }
    for (int i = 0; i < Mh; ++i) {
      if (alpha[i] >= 0.f)  // a block with nothing visible adds nothing
        accumulate_values<kD>(sch + i * bs, vb, vc_s, n, acc + (mb + i) * D, D, alpha[i]);
      pv.issue(per_v);
    }
    }
  }
}

void attend_tile(const AttnTile& t, const float* kc, const float* vc, int64_t kc_b, int64_t kc_s,
                 int64_t kc_h, int64_t vc_b, int64_t vc_s, int64_t vc_h, const int32_t* bt, int bs,
                 int window, float* qbuf,
                 float* acc, float* m_i, float* l_i, float* sc, int64_t* pos, float* alpha) {
  switch (t.head_dim) {
#define TANDEM_HEAD_DIM(n)                                                                     \
  case n:                                                                                      \
    return attend_tile_d<n>(t, kc, vc, kc_b, kc_s, kc_h, vc_b, vc_s, vc_h, bt, bs, window, qbuf, \
                            acc, m_i, l_i, sc, pos, alpha);
    TANDEM_HEAD_DIM(32)
    TANDEM_HEAD_DIM(64)
    TANDEM_HEAD_DIM(80)
    TANDEM_HEAD_DIM(96)
    TANDEM_HEAD_DIM(128)
#undef TANDEM_HEAD_DIM
    default:
      return attend_tile_d<0>(t, kc, vc, kc_b, kc_s, kc_h, vc_b, vc_s, vc_h, bt, bs, window,
                              qbuf, acc, m_i, l_i, sc, pos, alpha);
  }
}

}  // namespace

extern "C" {

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
  int covered = 0, tiles = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int lo = qsl ? qsl[s] : s, hi = qsl ? qsl[s + 1] : s + 1;
    tiles += (hi - lo + kQueryTile - 1) / kQueryTile;
  }
  const int heads_per_item = tiles >= 4 * num_threads ? num_kv_heads : 1;
  for (int s = 0; s < num_seqs; ++s) {
    const int lo = qsl ? qsl[s] : s, hi = qsl ? qsl[s + 1] : s + 1;
    covered = hi > covered ? hi : covered;
    if (seq_lens[s] <= 0) {
      for (int t = lo; t < hi; ++t)
        for (int h = 0; h < num_heads; ++h) std::memset(out + t * o_st + h * o_sh, 0, 4 * D);
      continue;
    }
    for (int r = lo; r < hi; r += kQueryTile)
      for (int h = 0; h < num_kv_heads; h += heads_per_item)
        items.push_back({s, h, h + heads_per_item, r, r + kQueryTile < hi ? r + kQueryTile : hi});
  }
  for (int t = covered; t < num_tokens; ++t)
    for (int h = 0; h < num_heads; ++h) std::memset(out + t * o_st + h * o_sh, 0, 4 * D);

  const int n_items = static_cast<int>(items.size());
#pragma omp parallel num_threads(num_threads) if (n_items > 1)
  {
    const int max_m = kQueryTile * group * heads_per_item;
    std::vector<float> qbuf(static_cast<size_t>(max_m) * D), acc(static_cast<size_t>(max_m) * D);
    std::vector<float> m_i(max_m), l_i(max_m), alpha(max_m);
    std::vector<float> sc(static_cast<size_t>(max_m) * block_size);
    std::vector<int64_t> pos(max_m);
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n_items; ++it) {
      const Item w = items[it];
      const int lo = qsl ? qsl[w.seq] : w.seq, hi = qsl ? qsl[w.seq + 1] : w.seq + 1;
      const int64_t ctx = seq_lens[w.seq] - (hi - lo);
      AttnTile tile{q, q_st, q_sh, scale, group, D, w, ctx - lo};
      attend_tile(tile, k_cache, v_cache, kc_b, kc_s, kc_h, vc_b, vc_s, vc_h,
                  block_tables + w.seq * bt_stride, block_size, window, qbuf.data(), acc.data(),
                  m_i.data(), l_i.data(), sc.data(), pos.data(), alpha.data());
      const int mh = (w.r1 - w.r0) * group;
      for (int h = w.h0; h < w.h1; ++h)
        for (int r = w.r0; r < w.r1; ++r)
          for (int g = 0; g < group; ++g) {
            const int m = (h - w.h0) * mh + (r - w.r0) * group + g;
            float* dst = out + r * o_st + (h * group + g) * o_sh;
            const float inv = l_i[m] > 0.f ? 1.f / l_i[m] : 0.f;
            for (int d = 0; d < D; ++d) dst[d] = acc[m * D + d] * inv;
          }
    }
  }
  return 0;
}

}  // extern "C"
