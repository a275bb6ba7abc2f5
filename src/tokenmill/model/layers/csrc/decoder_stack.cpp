#include "common.h"

// ---- A whole decoder stack for a step with block-quantized weights ----------------------------------
// The same kernels, in the same order, as the Python layers (so the result is bit-identical), called
// from one C++ loop: a decode step of a few rows spends most of its non-matmul time in Python and in
// per-op dispatch, not in the kernels themselves, and while one thread runs that Python the other cores
// wait. A step with prefill chunks (after its decode rows, if it has any) runs here too when every chunk takes
// one of the C++ prefill kernels (prefill_tables non-empty): its decode rows attend as a decode-only step's do,
// its chunks through paged_prefill_attention_bf16 (bf16_prefill) or paged_prefill_attention, as the Python
// backend sends them.
//
// layer_params holds kDecoderLayerParams tensors per layer: input norm weight; qkv q, scales, mins, bias;
// o q, scales, mins, bias; post-attention norm weight; gate_up q, scales, mins, bias; down q, scales,
// mins, bias; q norm and k norm weights (per head, before the rotary: Qwen3, Gemma 3); pre- and
// post-feedforward norm weights (Gemma's sandwich: the post-attention norm then norms the attention output
// alone). An empty (or undefined) tensor means none. Per layer: its KV cache group's slot mapping, decode rows'
// block table and context lengths (the first num_decodes rows), prefill chunks' block table and context
// lengths (prefill_ranges: each chunk's rows), its rotary table (cos[l], sin[l]) and sliding window (0: none);
// a windowed layer whose decode table reaches past its window attends through the prefill
// kernel, each row a one-token chunk (decode_ranges), as the Python backend does. gelu: GELU-tanh instead of
// SiLU. int8_activations: every projection through block_linear_q8 (--block-matmul int8) instead of
// block_linear. LoRA (--enable-lora, a step with adapter rows): lora_weights holds kLoRAParams tensors per layer,
// (A, Bᵀ) of qkv, o, gate_up and down as LoRALinear keeps them, lora_offsets each one's part offsets, lora_slots
// each row's slot (-1: the base model); each delta is added by lora_add right after its projection, as the
// Python layers add it. Empty lora_weights: no adapters. Returns the final norm of the residual stream,
// [rows, hidden].
namespace {
constexpr size_t kDecoderLayerParams = 22;
constexpr size_t kLoRAProjections = 4;  // qkv, o, gate_up, down
constexpr size_t kLoRAParams = 2 * kLoRAProjections;

// The projection's LoRA deltas added to y (its output for input x), when the step carries adapters.
struct StackLoRA {
  const std::vector<torch::Tensor>* weights;
  const std::vector<std::vector<int64_t>>* offsets;
  torch::Tensor slots;
  int64_t rank;

  void add(torch::Tensor& y, const torch::Tensor& x, size_t layer, size_t projection) const {
    if (weights->empty()) return;
    const size_t index = layer * kLoRAProjections + projection;
    lora_add(y, x, slots, (*weights)[2 * index], (*weights)[2 * index + 1], (*offsets)[index], rank);
  }
};

c10::optional<torch::Tensor> optional_tensor(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// One projection of the stack: w points at its (q, scales, mins, bias).
torch::Tensor stack_linear(const torch::Tensor& x, const torch::Tensor* w, int64_t out_features, bool int8_activations) {
  const auto linear = int8_activations ? block_linear_q8 : block_linear;
  return linear(x, w[0], w[1], optional_tensor(w[2]), optional_tensor(w[3]), out_features);
}

// K and V of each new token into its cache slot (the Python backend's index_copy_).
// A 16-bit cache stores each value rounded to nearest even, as torch's .to() does.
template <typename cache_t>
void write_kv_rows(const torch::Tensor& qkv, int64_t q_size, int64_t kv_size, torch::Tensor& kv_cache,
                   const int64_t* slots) {
  cache_t* cache = kv_cache.data_ptr<cache_t>();
  const int64_t plane = kv_cache.numel() / 2;  // K slots, then V slots
  const float* rows = qkv.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    const float* k = rows + t * stride + q_size;
    cache_t* k_slot = cache + slots[t] * kv_size;
    cache_t* v_slot = cache + plane + slots[t] * kv_size;
    for (int64_t i = 0; i < kv_size; ++i) {
      k_slot[i] = static_cast<cache_t>(k[i]);
      v_slot[i] = static_cast<cache_t>(k[kv_size + i]);
    }
  }
}

// An int8 cache's rows (kv_int8.py): each head's head_dim values quantized, their scales after them.
void write_kv_rows_int8(const torch::Tensor& qkv, int64_t q_size, int64_t kv_size, torch::Tensor& kv_cache,
                        const int64_t* slots) {
  int8_t* cache = kv_cache.data_ptr<int8_t>();
  const int64_t plane = kv_cache.numel() / 2;
  const int64_t heads = kv_cache.size(3), row = kv_cache.size(4), head_dim = kv_size / heads;
  const float* rows = qkv.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    const float* k = rows + t * stride + q_size;
    for (int64_t h = 0; h < heads; ++h) {
      quantize_kv_row(k + h * head_dim, head_dim, cache + (slots[t] * heads + h) * row);
      quantize_kv_row(k + kv_size + h * head_dim, head_dim, cache + plane + (slots[t] * heads + h) * row);
    }
  }
}

void write_kv(const torch::Tensor& qkv, int64_t q_size, int64_t kv_size, torch::Tensor& kv_cache,
              const int64_t* slots) {
  switch (kv_cache.scalar_type()) {
    case torch::kChar: return write_kv_rows_int8(qkv, q_size, kv_size, kv_cache, slots);
    case torch::kHalf: return write_kv_rows<at::Half>(qkv, q_size, kv_size, kv_cache, slots);
    case torch::kBFloat16: return write_kv_rows<at::BFloat16>(qkv, q_size, kv_size, kv_cache, slots);
    default: return write_kv_rows<float>(qkv, q_size, kv_size, kv_cache, slots);
  }
}
}  // namespace

// The fused stack's KV writer on its own: qkv [rows, q_size + 2 * kv_size] float32 rows (q, then k, then v), each
// row's k and v into its slot of kv_cache (any cache dtype the stack reads). Stores the bytes the Python writer
// (kv_write.write_kv) stores.
void write_kv_cache(torch::Tensor qkv, int64_t q_size, int64_t kv_size, torch::Tensor kv_cache,
                    torch::Tensor slot_mapping) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat && qkv.stride(1) == 1 &&
              qkv.size(1) == q_size + 2 * kv_size, "qkv: float32 [rows, q_size + 2 * kv_size] with contiguous rows");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous 5-D");
  const int64_t heads = kv_cache.size(3);
  TORCH_CHECK(kv_size % heads == 0 && kv_rows_hold(kv_cache, kv_size / heads),
              "kv_size must be the cache's heads x head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == qkv.size(0), "slot_mapping: int64 [rows]");
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < qkv.size(0); ++t) TORCH_CHECK(0 <= slot[t] && slot[t] < slots, "slot out of range");
  write_kv(qkv, q_size, kv_size, kv_cache, slot);
}

namespace {
bool present(const torch::Tensor& t) { return t.defined() && t.numel() > 0; }

// RMSNorm over each head of a [rows, heads * head_dim] slice of qkv (the Python layers' q_norm / k_norm on a
// contiguous copy of it), returned as [rows, heads * head_dim].
torch::Tensor norm_heads(const torch::Tensor& qkv, int64_t offset, int64_t heads, int64_t head_dim,
                         const torch::Tensor& weight, double eps) {
  const int64_t rows = qkv.size(0);
  torch::Tensor part = qkv.narrow(1, offset, heads * head_dim).contiguous().view({rows * heads, head_dim});
  return rms_norm(part, torch::empty({0}, qkv.options()), weight, eps).view({rows, heads * head_dim});
}

// gelu_tanh(gate) * up with ATen's own ops, as the Python layer computes it.
torch::Tensor gelu_tanh_and_mul(const torch::Tensor& gate_up) {
  auto parts = gate_up.chunk(2, 1);
  return at::gelu(parts[0], "tanh") * parts[1];
}
}  // namespace

torch::Tensor decoder_decode_int8(torch::Tensor hidden, torch::Tensor positions, std::vector<torch::Tensor> slot_mappings,
                                  std::vector<torch::Tensor> block_tables, std::vector<torch::Tensor> context_lens,
                                  torch::Tensor decode_ranges, std::vector<torch::Tensor> kv_caches, std::vector<torch::Tensor> layer_params,
                                  std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin,
                                  std::vector<int64_t> windows, torch::Tensor final_norm, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, double eps, double scale, double softcap,
                                  bool gelu, bool int8_activations, std::vector<torch::Tensor> lora_weights,
                                  std::vector<std::vector<int64_t>> lora_offsets, torch::Tensor lora_slots,
                                  int64_t lora_rank, int64_t num_decodes, std::vector<torch::Tensor> prefill_tables,
                                  torch::Tensor prefill_ranges, std::vector<torch::Tensor> prefill_context_lens,
                                  bool bf16_prefill) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == torch::kFloat,
              "hidden: contiguous float32 [rows, hidden]");
  const size_t layers = kv_caches.size();
  TORCH_CHECK(layer_params.size() == layers * kDecoderLayerParams, "22 parameters per layer");
  TORCH_CHECK(cos.size() == layers && sin.size() == layers && windows.size() == layers &&
              slot_mappings.size() == layers && block_tables.size() == layers && context_lens.size() == layers,
              "one rotary table, window, slot mapping, block table and context lengths per layer");
  TORCH_CHECK(lora_weights.empty() || (lora_weights.size() == layers * kLoRAParams &&
                                       lora_offsets.size() == layers * kLoRAProjections &&
                                       lora_slots.numel() == hidden.size(0)),
              "LoRA: (A, Bt) of 4 projections per layer, their offsets, and one slot per row");
  const StackLoRA lora{&lora_weights, &lora_offsets, lora_slots, lora_rank};
  const int64_t rows = hidden.size(0);
  const bool prefill = !prefill_tables.empty();
  TORCH_CHECK(prefill ? prefill_tables.size() == layers && prefill_context_lens.size() == layers &&
                            0 <= num_decodes && num_decodes < rows
                      : num_decodes == rows,
              "a decode-only step's rows are all decodes; a step that prefills has tables and lengths per layer");
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, hidden_size = hidden.size(1);
  const torch::Tensor none = torch::empty({0}, hidden.options());
  torch::Tensor x = hidden, residual;
  for (size_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = layer_params.data() + l * kDecoderLayerParams;
    torch::Tensor& cache = kv_caches[l];
    const torch::Tensor& slot_mapping = slot_mappings[l];
    TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.is_contiguous() &&
                slot_mapping.numel() == rows, "slot_mapping: int64 [rows]");
    const auto cache_type = cache.scalar_type();
    TORCH_CHECK(cache.is_contiguous() &&
                (cache_type == torch::kFloat || cache_type == torch::kHalf || cache_type == torch::kBFloat16 ||
                 cache_type == torch::kChar) &&
                cache.size(3) == num_kv_heads && kv_rows_hold(cache, head_dim),
                "kv cache: contiguous float32, float16, bfloat16 or int8 (with scales) with matching heads");
    torch::Tensor h;
    if (l == 0) {
      residual = x;
      h = rms_norm(x, none, w[0], eps);
    } else {
      h = rms_norm(x, residual, w[0], eps);  // residual += x, in place
    }
    torch::Tensor qkv = stack_linear(h, w + 1, q_size + 2 * kv_size, int8_activations);
    lora.add(qkv, h, l, 0);
    if (present(w[18])) {  // q/k norms: one contiguous row of q, k, v again for the in-place rotary
      qkv = torch::cat({norm_heads(qkv, 0, num_heads, head_dim, w[18], eps),
                        norm_heads(qkv, q_size, num_kv_heads, head_dim, w[19], eps),
                        qkv.narrow(1, q_size + kv_size, kv_size)}, 1);
    }
    rotary_inplace(qkv, positions, cos[l], sin[l], num_heads + num_kv_heads, head_dim);
    write_kv(qkv, q_size, kv_size, cache, slot_mapping.data_ptr<int64_t>());
    torch::Tensor query = qkv.narrow(1, 0, q_size).contiguous().view({rows, num_heads, head_dim});
    torch::Tensor attn;
    const bool windowed_decodes = windows[l] > 0 && block_tables[l].size(1) * cache.size(2) > windows[l];
    if (!prefill && !windowed_decodes) {
      attn = paged_decode_attention(query, cache, block_tables[l], context_lens[l], scale, softcap);
    } else {
      attn = torch::empty_like(query);
      if (num_decodes > 0 && windowed_decodes) {
        paged_prefill_attention(query, cache, block_tables[l], decode_ranges, context_lens[l], scale, softcap,
                                windows[l], attn);
      } else if (num_decodes > 0) {
        attn.narrow(0, 0, num_decodes)
            .copy_(paged_decode_attention(query.narrow(0, 0, num_decodes), cache, block_tables[l], context_lens[l],
                                          scale, softcap));
      }
      if (prefill && bf16_prefill) {
        paged_prefill_attention_bf16(query, cache, prefill_tables[l], prefill_ranges, prefill_context_lens[l], scale,
                                     windows[l], attn);
      } else if (prefill) {
        paged_prefill_attention(query, cache, prefill_tables[l], prefill_ranges, prefill_context_lens[l], scale,
                                softcap, windows[l], attn);
      }
    }
    torch::Tensor attn_rows = attn.view({rows, q_size});
    h = stack_linear(attn_rows, w + 5, hidden_size, int8_activations);
    lora.add(h, attn_rows, l, 1);
    const bool sandwich = present(w[20]);
    if (sandwich) {
      h = rms_norm(h, none, w[9], eps);
      h = rms_norm(h, residual, w[20], eps);
    } else {
      h = rms_norm(h, residual, w[9], eps);
    }
    const int64_t intermediate_size = w[14].size(1) * kQ8Block;  // down's inputs ([panels, K / 32, 32, 16 or 8])
    torch::Tensor gate_up = stack_linear(h, w + 10, 2 * intermediate_size, int8_activations);
    lora.add(gate_up, h, l, 2);
    h = gelu ? gelu_tanh_and_mul(gate_up) : silu_and_mul(gate_up);
    x = stack_linear(h, w + 14, hidden_size, int8_activations);
    lora.add(x, h, l, 3);
    if (sandwich) x = rms_norm(x, none, w[21], eps);
  }
  return rms_norm(x, residual, final_norm, eps);
}
