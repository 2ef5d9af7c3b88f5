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

#include "cpu_attention_block.h"
#include "cpu_kernels.h"
#include "cpu_simd.h"

namespace {

using namespace tandem;
using namespace tandem::attn;

constexpr int kQueryTile = 16;  // query rows of one sequence handled together (extend)

// One work item: query rows [r0, r1) of one sequence (absolute positions ctx + r) for the query
// heads of KV heads [h0, h1). All KV heads at once when there are enough items to go round the
// threads: a position's K (and V) row of every head is then one contiguous read.
struct Item {
  int seq, h0, h1, r0, r1;
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
      pk.stop();
      pv.stop();
    }
    for (int h = 0; h < nh; ++h) {
    const float* kb = kb0 + (t.w.h0 + h) * kc_h;
    const float* vb = vb0 + (t.w.h0 + h) * vc_h;
    float* sch = sc + static_cast<int64_t>(h) * Mh * bs;
    const int mb = h * Mh;
    int i = 0;
    if constexpr (kD > 0) {
      for (; i + 2 <= Mh; i += 2) {
        score_keys2<kD>(qbuf + (mb + i) * D, kb, kc_s, n, sch + i * bs, sch + (i + 1) * bs);
        pk.issue(2 * per_k);
      }
    }
    for (; i < Mh; ++i) {
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
