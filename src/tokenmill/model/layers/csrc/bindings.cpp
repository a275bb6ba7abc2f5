// The Python module: every operation of the kernel files, and what this build and CPU run.

#include <torch/extension.h>

#include "common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(TOKENMILL_AVX512)
  m.attr("simd") = "avx512";
#elif defined(TOKENMILL_AVX2)
  m.attr("simd") = "avx2";
#else
  m.attr("simd") = "portable";
#endif
#if defined(TOKENMILL_VNNI)
  m.attr("int8_dot") = "avx512_vnni";
#elif defined(TOKENMILL_DOT_AVX2)
  m.attr("int8_dot") = "avx2";
#else
  m.attr("int8_dot") = "portable";
#endif
  // Every kernel runs without the GIL (arguments are converted before, results after), so the
  // server's HTTP thread can stream and tokenize while the engine thread is inside one.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("argmax_rows", &argmax_rows,
        "each row's index of its first maximum (the first NaN where a row has one), as torch.argmax(x, dim=1) "
        "on float32 rows", py::arg("x"), nogil);
  m.def("uniform_rows", &uniform_rows,
        "[rows, n] float32 uniforms strictly inside (0, 1), row r from seeds[r] alone (SplitMix64 on a counter)",
        py::arg("seeds"), py::arg("n"), nogil);
  m.def("lora_add", &lora_add,
        "y[t] += B_s (A_s x[t]) for each row t of slot s >= 0 (LoRA deltas; a slot-major A, B transposed)",
        py::arg("y"), py::arg("x"), py::arg("slots"), py::arg("a"), py::arg("bt"), py::arg("offsets"),
        py::arg("rank"), nogil);
  m.def("block_linear", &block_linear,
        "x @ dequant(block-quantized weights)^T + bias for float32 x (weights in pack_blocks's layout)",
        py::arg("x"), py::arg("q"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("out_features"),
        nogil);
  m.def("block_linear_bf16", &block_linear_bf16,
        "block_linear with steps of more than 64 rows multiplied in bfloat16 (x and each dequantized tile "
        "rounded to it; float32 accumulation; --block-matmul bfloat16)",
        py::arg("x"), py::arg("q"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("out_features"),
        nogil);
#if defined(TOKENMILL_AMX)
  m.def("bf16_tiles", [] { return amx_permitted() ? "amx" : gemm_bf16bf16f32_ != nullptr ? "mkl" : "at::mm"; },
#else
  m.def("bf16_tiles", [] { return gemm_bf16bf16f32_ != nullptr ? "mkl" : "at::mm"; },
#endif
        "what multiplies block_linear_bf16's tiles here: tokenmill's AMX-BF16 tiles, MKL's bfloat16 GEMM or at::mm");
  m.def("bf16_gemm_available", [] { return gemm_bf16bf16f32_ != nullptr; },
        "whether torch's MKL exports its bfloat16 GEMM (block_linear_bf16 falls back to float32 at::mm without)");
  m.def("block_linear_q8", &block_linear_q8,
        "block_linear with x rounded per block of 32 to int8 and integer dot products (--block-matmul int8)",
        py::arg("x"), py::arg("q"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("out_features"),
        nogil);
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (one query token per request); softcap > 0 caps the scores",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("softcap") = 0.0, nogil);
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prefill chunks over a paged KV cache, written into out; window > 0 limits each "
        "query to its last `window` keys, softcap > 0 caps the scores",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("query_ranges"),
        py::arg("context_lens"), py::arg("scale"), py::arg("softcap"), py::arg("window"), py::arg("out"), nogil);
  m.def("paged_prefill_attention_bf16", &paged_prefill_attention_bf16,
        "paged_prefill_attention (no soft-cap) on AMX tiles or AVX-512 BF16 dot products: scores from high and low bfloat16 parts of q and k, "
        "v and the probabilities rounded to bfloat16", py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("query_ranges"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window"), py::arg("out"), nogil);
  m.def("bf16_decode_attention_available", &bf16_decode_attention_available,
        "whether paged_decode_attention multiplies in bfloat16 products over a bfloat16 cache here (AVX-512 BF16)");
  m.def("bf16_attention_available", &bf16_attention_available,
        "whether paged_prefill_attention_bf16 runs here (AMX-BF16 tiles the CPU grants, or AVX-512 BF16)");
  m.def("bf16_attention_path", &bf16_attention_path,
        "what paged_prefill_attention_bf16 multiplies with here: 'amx', 'avx512_bf16' or '' (it cannot run)");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :I]) * x[:, I:]", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally fused with the residual add (residual updated in place)", nogil);
  m.def("write_kv_cache", &write_kv_cache,
        "the decoder stack's KV writer: each qkv row's k and v into its slot (an int8 cache's rows with scales)",
        nogil);
  m.def("decoder_decode_int8", &decoder_decode_int8,
        "a whole decoder stack (block-quantized weights) for a decode-only or mixed step", nogil);
  m.def("rotary_inplace", &rotary_inplace, "rotate-half rotary embedding in place on the first heads of each row",
        nogil);
  m.def("pack_block_integers", &pack_block_integers,
        "block integers (parts int8 [rows, K], stacked) in the kernels' panels of 16 features (rows or dot "
        "layout, 4 or 8 bits)",
        py::arg("parts"), py::arg("bits"), py::arg("dot"), py::arg("offset"), nogil);
  m.def("unpack_q4_k", &unpack_q4_k, "a GGUF Q4_K matrix's integers, per-32 scales and mins", nogil);
  m.def("q6_k_to_q8_0", &q6_k_to_q8_0, "a GGUF Q6_K matrix rounded to Q8_0 (integers, float16 scales as float32)",
        nogil);
}
