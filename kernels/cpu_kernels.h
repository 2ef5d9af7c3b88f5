// The C ABI of cpu_kernels.cpp, for cpu_forward.cpp (the fused forward calls the same kernels the
// checked Python wrappers in tandem/kernels/cpu_ops.py call). See cpu_kernels.cpp for each one,
// and cpu_linear.cpp for the few-row linear layer.
#pragma once

#include <cstdint>

extern "C" {
int tandem_check_attention_meta(const int32_t* block_tables, int64_t bt_stride, int max_blocks,
                                int num_blocks, const int32_t* qsl, const int32_t* seq_lens,
                                int num_seqs, int num_tokens, int block_size);
int tandem_kv_cache_write_f32(const float* k, const float* v, int64_t k_st, int64_t k_sh,
                              int64_t v_st, int64_t v_sh, float* k_cache, float* v_cache,
                              int64_t kc_b, int64_t kc_s, int64_t kc_h, int64_t vc_b,
                              int64_t vc_s, int64_t vc_h, const int64_t* slots,
                              int64_t num_slots, int num_tokens, int num_heads, int head_dim,
                              int block_size, int num_threads);
int tandem_paged_attention_f32(const float* q, int64_t q_st, int64_t q_sh, const float* k_cache,
                               const float* v_cache, int64_t kc_b, int64_t kc_s, int64_t kc_h,
                               int64_t vc_b, int64_t vc_s, int64_t vc_h,
                               const int32_t* block_tables, int64_t bt_stride, int max_blocks,
                               int num_blocks, const int32_t* qsl, const int32_t* seq_lens,
                               int num_seqs, int num_tokens, int num_heads, int num_kv_heads,
                               int head_dim, int block_size, float scale, int window, float* out,
                               int64_t o_st, int64_t o_sh, int num_threads);
void tandem_rms_norm_f32(const float* x, int64_t x_st, const float* residual, int64_t r_st,
                         const float* weight, float eps, float* out, int64_t o_st,
                         float* residual_out, int64_t ro_st, int num_tokens, int hidden,
                         int num_threads);
void tandem_silu_and_mul_f32(const float* x, int64_t x_st, float* out, int64_t o_st,
                             int num_tokens, int inter, int num_threads);
int tandem_rotary_f32(const int64_t* positions, float* q, int64_t q_st, int64_t q_sh, float* k,
                      int64_t k_st, int64_t k_sh, const float* cos_sin, int64_t max_pos,
                      int rot_dim, int num_tokens, int num_q_heads, int num_k_heads,
                      int num_threads);
void tandem_argmax_f32(const float* x, int64_t x_st, int rows, int cols, int64_t* out,
                       int num_threads);
void tandem_linear_f32(const float* a, int64_t a_st, const float* w, const float* bias, float* c,
                       int64_t c_st, int num_tokens, int n, int k, int num_threads);
}
