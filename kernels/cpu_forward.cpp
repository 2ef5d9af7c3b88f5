// The Llama-family decoder forward in one call: embedding, every layer (RMSNorm, QKV projection
// with optional bias, optional per-head q/k RMSNorm, rotary, KV write, paged attention with the
// layer's sliding window, output projection, residual RMSNorm, gate/up projection, SiLU-and-mul,
// down projection) and the final norm, for float32 on CPU.
//
// Called once per step by tandem/engine/cpu_forward.py (CpuForward), which builds the Plan once
// (weight pointers, shapes) and a Step per step (input and scratch pointers). It is the CPU
// counterpart of the CUDA graphs the GPU path uses: the per-op Python dispatch of an eager step
// (hundreds of small calls at batch 1) becomes one call. The kernels are cpu_kernels.cpp's, the
// same the checked wrappers run and tests/kernels holds to the PyTorch references; the matrix
// products of steps with at most Plan::linear_rows rows run cpu_linear.cpp's kernel (it streams
// the weights faster than the BLAS at a few rows), larger ones the sgemm_ of the BLAS torch
// itself uses (MKL), looked up in torch's library.
// tests/engine holds the whole forward to the eager model and to Hugging Face, token for token.

#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

namespace {

using sgemm_t = void (*)(const char*, const char*, const int*, const int*, const int*,
                         const float*, const float*, const int*, const float*, const int*,
                         const float*, float*, const int*);

// Per layer, as int64 addresses (0 = absent): the order of LAYER_FIELDS in cpu_forward.py.
enum LayerField {
  kInputNorm, kQkvW, kQkvB, kQNorm, kKNorm, kOW, kPostNorm, kGateUpW, kDownW, kWindow, kNumFields
};

struct Plan {
  int num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, rot_dim, vocab;
  int block_size, num_blocks;
  float eps, scale;
  const float* embed;       // [vocab, hidden]
  const float* final_norm;  // [hidden]
  const float* cos_sin;     // [max_pos, rot_dim]
  int64_t max_pos;
  float* kv_cache;  // [blocks, layers, 2, block_size, kv_heads, head_dim], contiguous
  const int64_t* layers;  // [num_layers, kNumFields]
  sgemm_t sgemm;
  int linear_rows;  // steps of at most this many rows skip the BLAS (cpu_ops.LINEAR_MAX_ROWS)
};

struct Step {
  const int64_t* ids;        // [T]
  const int64_t* positions;  // [T]
  const int64_t* slots;      // [T]
  const int32_t* block_tables;
  int64_t bt_stride;
  int max_blocks;
  const int32_t* qsl;  // [S + 1], or null: decode (row i is sequence i)
  const int32_t* seq_lens;
  int num_seqs, num_tokens, num_threads;
  // Scratch, each [T, width] contiguous: h/residual/normed [hidden], qkv [q + 2 kv],
  // attn [q], gate_up [2 inter], act [inter]; out [T, hidden] receives the final hidden states.
  float *h, *residual, *normed, *qkv, *attn, *gate_up, *act, *out;
};

// C[T, N] = A[T, K] @ W[N, K]^T, all row-major and contiguous (column-major BLAS: C^T = W A^T).
void linear(const Plan& p, const float* a, const float* w, float* c, int t, int n, int k,
            int nt) {
  if (t <= p.linear_rows) return tandem_linear_f32(a, k, w, nullptr, c, n, t, n, k, nt);
  const float one = 1.f, zero = 0.f;
  p.sgemm("T", "N", &n, &t, &k, &one, w, &k, a, &k, &zero, c, &n);
}

}  // namespace

extern "C" {

// Returns 0, or a negative code naming what is out of range (nothing written then):
// -1 a token id, -2 a position, -3 a slot, -(4 + s) the attention metadata of sequence s.
int tandem_llama_forward_f32(const Plan* plan, const Step* step) {
  const Plan& p = *plan;
  const Step& st = *step;
  const int T = st.num_tokens, H = p.hidden, D = p.head_dim;
  const int qs = p.num_heads * D, kvs = p.num_kv_heads * D, qkv_w = qs + 2 * kvs;
  const int64_t num_slots = static_cast<int64_t>(p.num_blocks) * p.block_size;
  for (int t = 0; t < T; ++t) {
    if (st.ids[t] < 0 || st.ids[t] >= p.vocab) return -1;
    if (st.positions[t] < 0 || st.positions[t] >= p.max_pos) return -2;
    if (st.slots[t] >= num_slots) return -3;
  }
  const int bad = tandem_check_attention_meta(st.block_tables, st.bt_stride, st.max_blocks,
                                              p.num_blocks, st.qsl, st.seq_lens, st.num_seqs, T,
                                              p.block_size);
  if (bad) return -(3 + bad);

  for (int t = 0; t < T; ++t)
    std::memcpy(st.h + static_cast<int64_t>(t) * H, p.embed + st.ids[t] * H, sizeof(float) * H);
  // Cache strides in elements: block, then within a layer's K or V view: slot, head.
  const int64_t s_head = D, s_slot = static_cast<int64_t>(p.num_kv_heads) * D;
  const int64_t s_kv = s_slot * p.block_size, s_layer = 2 * s_kv;
  const int64_t s_block = s_layer * p.num_layers;
  const int nt = st.num_threads;
  for (int l = 0; l < p.num_layers; ++l) {
    const int64_t* f = p.layers + static_cast<int64_t>(l) * kNumFields;
    auto wp = [&](int field) { return reinterpret_cast<const float*>(f[field]); };
    // The first layer's norm has no residual yet: residual = h.
    if (l == 0) {
      std::memcpy(st.residual, st.h, sizeof(float) * T * H);
      tandem_rms_norm_f32(st.h, H, nullptr, 0, wp(kInputNorm), p.eps, st.normed, H, nullptr, 0,
                          T, H, nt);
    } else {
      tandem_rms_norm_f32(st.h, H, st.residual, H, wp(kInputNorm), p.eps, st.normed, H,
                          st.residual, H, T, H, nt);
    }
    linear(p, st.normed, wp(kQkvW), st.qkv, T, qkv_w, H, nt);
    if (const float* bias = wp(kQkvB))
      for (int t = 0; t < T; ++t)
        for (int i = 0; i < qkv_w; ++i) st.qkv[static_cast<int64_t>(t) * qkv_w + i] += bias[i];
    float* q = st.qkv;
    float* k = st.qkv + qs;
    float* v = st.qkv + qs + kvs;
    if (wp(kQNorm)) {  // Qwen3: RMSNorm over each head of q and of k (via attn as scratch)
      for (int t = 0; t < T; ++t) {
        float* qt = q + static_cast<int64_t>(t) * qkv_w;
        float* kt = k + static_cast<int64_t>(t) * qkv_w;
        tandem_rms_norm_f32(qt, D, nullptr, 0, wp(kQNorm), p.eps, st.attn, D, nullptr, 0,
                            p.num_heads, D, 1);
        std::memcpy(qt, st.attn, sizeof(float) * qs);
        tandem_rms_norm_f32(kt, D, nullptr, 0, wp(kKNorm), p.eps, st.attn, D, nullptr, 0,
                            p.num_kv_heads, D, 1);
        std::memcpy(kt, st.attn, sizeof(float) * kvs);
      }
    }
    tandem_rotary_f32(st.positions, q, qkv_w, D, k, qkv_w, D, p.cos_sin, p.max_pos, p.rot_dim, T,
                      p.num_heads, p.num_kv_heads, nt);
    float* kc = p.kv_cache + l * s_layer;
    float* vc = kc + s_kv;
    tandem_kv_cache_write_f32(k, v, qkv_w, D, qkv_w, D, kc, vc, s_block, s_slot, s_head, s_block,
                              s_slot, s_head, st.slots, num_slots, T, p.num_kv_heads, D,
                              p.block_size, nt);
    tandem_paged_attention_f32(q, qkv_w, D, kc, vc, s_block, s_slot, s_head, s_block, s_slot,
                               s_head, st.block_tables, st.bt_stride, st.max_blocks,
                               p.num_blocks, st.qsl, st.seq_lens, st.num_seqs, T, p.num_heads,
                               p.num_kv_heads, D, p.block_size, p.scale,
                               static_cast<int>(f[kWindow]), st.attn, qs, D, nt);
    linear(p, st.attn, wp(kOW), st.h, T, H, qs, nt);
    tandem_rms_norm_f32(st.h, H, st.residual, H, wp(kPostNorm), p.eps, st.normed, H, st.residual,
                        H, T, H, nt);
    linear(p, st.normed, wp(kGateUpW), st.gate_up, T, 2 * p.inter, H, nt);
    tandem_silu_and_mul_f32(st.gate_up, 2 * p.inter, st.act, p.inter, T, p.inter, nt);
    linear(p, st.act, wp(kDownW), st.h, T, H, p.inter, nt);
  }
  tandem_rms_norm_f32(st.h, H, st.residual, H, p.final_norm, p.eps, st.out, H, st.residual, H, T,
                      H, nt);
  return 0;
}

}  // extern "C"
