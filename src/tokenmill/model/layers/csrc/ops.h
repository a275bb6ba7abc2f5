// The operations each kernel file defines and the bindings (or another file) call.
#pragma once

#include <string>
#include <vector>

#include <ATen/ATen.h>

// decode_attention.cpp
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, double softcap);
bool bf16_decode_attention_available();
// prefill_attention.cpp
void paged_prefill_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                             torch::Tensor query_ranges, torch::Tensor context_lens, double scale, double softcap,
                             int64_t window, torch::Tensor out);
void paged_prefill_attention_bf16(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                                  torch::Tensor query_ranges, torch::Tensor context_lens, double scale, int64_t window,
                                  torch::Tensor out);
std::string bf16_attention_path();
bool bf16_attention_available();
// elementwise.cpp
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    int64_t num_heads, int64_t head_dim);
torch::Tensor argmax_rows(torch::Tensor x);
torch::Tensor uniform_rows(torch::Tensor seeds, int64_t n);
// block_linear.cpp
torch::Tensor block_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                           c10::optional<torch::Tensor> bias, int64_t out_features);
torch::Tensor block_linear_bf16(torch::Tensor x, torch::Tensor q, torch::Tensor scales,
                                c10::optional<torch::Tensor> mins, c10::optional<torch::Tensor> bias,
                                int64_t out_features);
// int8_dot.cpp
torch::Tensor block_linear_q8(torch::Tensor x, torch::Tensor q, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                              c10::optional<torch::Tensor> bias, int64_t out_features);
// lora.cpp
void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor slots, torch::Tensor a, torch::Tensor bt,
              std::vector<int64_t> offsets, int64_t rank);
// decoder_stack.cpp
void write_kv_cache(torch::Tensor qkv, int64_t q_size, int64_t kv_size, torch::Tensor kv_cache,
                    torch::Tensor slot_mapping);
torch::Tensor decoder_decode_int8(torch::Tensor hidden, torch::Tensor positions, std::vector<torch::Tensor> slot_mappings,
                                  std::vector<torch::Tensor> block_tables, std::vector<torch::Tensor> context_lens,
                                  torch::Tensor decode_ranges, std::vector<torch::Tensor> kv_caches,
                                  std::vector<torch::Tensor> layer_params, std::vector<torch::Tensor> cos,
                                  std::vector<torch::Tensor> sin, std::vector<int64_t> windows, torch::Tensor final_norm,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                                  double softcap, bool gelu, bool int8_activations,
                                  std::vector<torch::Tensor> lora_weights, std::vector<std::vector<int64_t>> lora_offsets,
                                  torch::Tensor lora_slots, int64_t lora_rank, int64_t num_decodes,
                                  std::vector<torch::Tensor> prefill_tables, torch::Tensor prefill_ranges,
                                  std::vector<torch::Tensor> prefill_context_lens, bool bf16_prefill);
// weight_packing.cpp
torch::Tensor pack_block_integers(std::vector<torch::Tensor> parts, int64_t bits, bool dot, int64_t offset);
std::vector<torch::Tensor> unpack_q4_k(torch::Tensor raw);
std::vector<torch::Tensor> q6_k_to_q8_0(torch::Tensor raw);
