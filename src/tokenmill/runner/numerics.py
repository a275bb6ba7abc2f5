"""How the engine computes, chosen once at start-up from the hardware: the model's dtype, the arithmetic of
block-quantized matmuls (`--block-matmul`) and the KV cache's dtype.

Each of the options left at `auto` takes the fastest path this machine runs whose accuracy is measured
(docs/benchmarks.md, "Accuracy of the numerics"); `--numerics exact` pins the weights as stored and the
other three to float32, which matches HF transformers' float32 outputs token for token. On a CPU:

    option          auto picks                                                      because
    quantization    q8_0           dense weights (safetensors, a float GGUF) where  1.4-1.9x the 16-bit model's
                                   the int8 dot kernels run, --dtype and            speed at 1B, perplexity
                                   --block-matmul left at auto, no experts          within 0.5% of it
                    as stored      elsewhere (a GGUF's kept blocks stay so)
    block_matmul    bfloat16-int8  with AMX-BF16 and the int8 dot kernels           tiles for prefill, int8 rows
                                                                                    for decode
                    int8           with the int8 dot kernels (AVX-512 VNNI, AVX2)   integer dot products, as llama.cpp
                    float32        elsewhere, or when no weights are block-quantized
    dtype           float32        when the weights are block-quantized (kept GGUF  the block kernels compute in float32
                                   blocks, q8_0) and the C++ kernels run them
                    bfloat16       dense weights on a CPU with AVX-512 BF16 or AMX  oneDNN's bfloat16 matmuls, as vLLM
                    float32        elsewhere
    kv_cache_dtype  bfloat16       under a float32 model on a CPU with native bf16  half the bytes per decode step
                    float16        under a float32 model elsewhere (F16C widens it)
                    = dtype        under a 16-bit model, or without the C++ kernels

`resolve_numerics` is a pure function of the config, the `Hardware` and the kind of weights, so every CPU
feature set's choice is tested with injected flags; `detect_hardware` reads the real machine.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from tokenmill.config import EngineConfig

# The flags the kernels' int8 dot paths are compiled for (-march=native; see csrc/common.h).
_VNNI_DOT_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni", "avx512vbmi", "avx2", "fma"})
_AVX2_DOT_FLAGS = frozenset({"avx2", "fma"})
_AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
EXACT = "float32"


@dataclass(frozen=True, slots=True)
class Hardware:
    """What the numerics depend on. device_type: "cpu" or "cuda"; cpu_flags: /proc/cpuinfo's; cpu_kernels:
    tokenmill's C++ kernels load and the attention backend setting lets the engine use them; int8_dot: the
    kernels' SIMD integer dot-product path ("avx512_vnni", "avx2") or None; cuda_bf16: the CUDA device
    computes bfloat16."""

    device_type: str
    cpu_flags: frozenset[str] = frozenset()
    cpu_kernels: bool = False
    int8_dot: Optional[str] = None
    cuda_bf16: bool = False

    @classmethod
    def for_cpu_flags(cls, flags, cpu_kernels: bool = True) -> "Hardware":
        """The hardware a CPU with these flags presents once the kernels are built for it (-march=native)."""
        flags = frozenset(flags)
        int8_dot = None
        if cpu_kernels:
            int8_dot = "avx512_vnni" if _VNNI_DOT_FLAGS <= flags else "avx2" if _AVX2_DOT_FLAGS <= flags else None
        return cls("cpu", flags, cpu_kernels, int8_dot)

    @property
    def amx(self) -> bool:
        return _AMX_FLAGS <= self.cpu_flags

    @property
    def native_bf16(self) -> Optional[str]:
        """The CPU flag that gives it bfloat16 arithmetic, or None."""
        return "amx_bf16" if self.amx else "avx512_bf16" if "avx512_bf16" in self.cpu_flags else None

    def describe(self) -> str:
        if self.device_type != "cpu":
            return self.device_type
        shown = [flag for flag in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16")
                 if flag in self.cpu_flags]
        kernels = "C++ kernels" if self.cpu_kernels else "no C++ kernels"
        return f"cpu ({', '.join(shown) or 'no AVX2'}; {kernels})"


@dataclass(frozen=True, slots=True)
class Choice:
    value: str
    reason: str


# The weights' value where they load as the file holds them (`--quantization` unset keeps it unset).
AS_STORED = "as stored"


@dataclass(frozen=True, slots=True)
class Numerics:
    dtype: Choice
    block_matmul: Choice
    kv_cache_dtype: Choice
    weights: Choice

    def apply(self, config: EngineConfig) -> EngineConfig:
        """A new config holding the resolved values (`auto` no longer appears in them; dense weights chosen
        for Q8_0 carry `--quantization q8_0`)."""
        quantization = config.quantization if self.weights.value == AS_STORED else self.weights.value
        return dataclasses.replace(config, dtype=self.dtype.value, block_matmul=self.block_matmul.value,
                                   kv_cache_dtype=self.kv_cache_dtype.value, quantization=quantization)

    def as_dict(self) -> dict[str, dict[str, str]]:
        """{"dtype": {"value": ..., "reason": ...}, ...}: what /stats reports."""
        return {name: {"value": choice.value, "reason": choice.reason} for name, choice in self._items()}

    def describe(self) -> str:
        """The start-up log line: `dtype: float32 (GGUF blocks kept ...); block matmul: int8 (avx512_vnni); ...`."""
        return "; ".join(f"{name.replace('_', ' ')}: {choice.value} ({choice.reason})"
                         for name, choice in self._items())

    def _items(self):
        return (("weights", self.weights), ("dtype", self.dtype), ("block_matmul", self.block_matmul),
                ("kv_cache_dtype", self.kv_cache_dtype))


def resolve_numerics(config: EngineConfig, hardware: Hardware, block_weights: bool,
                     experts: bool = False) -> Numerics:
    """The weights' format, dtype, block matmul and KV cache dtype this engine runs. block_weights: whether
    the file's matrices are in a type the block kernels keep as stored (a GGUF's Q8_0, Q4_K ...; with
    `--quantization` unset or gguf); experts: the model has mixture-of-experts layers (whose experts stay
    dense under every conversion). Explicit values are kept; `auto` ones are chosen from `hardware`;
    `--numerics exact` pins dtype, block matmul and KV cache to float32 and loads the weights as stored."""
    if config.numerics == "exact":  # the config refuses any other explicit value with it
        exact = Choice(EXACT, "--numerics exact")
        weights = (Choice(config.quantization, "--quantization") if config.quantization is not None
                   else Choice(AS_STORED, "--numerics exact"))
        return Numerics(exact, exact, exact, weights)
    weights = _weights(config, hardware, block_weights, experts)
    block_weights = block_weights or weights.value == "q8_0"
    dtype = _dtype(config, hardware, block_weights, weights.value == "q8_0")
    blocks_run = block_weights and _blocks_run(hardware, dtype.value)
    return Numerics(dtype, _block_matmul(config, hardware, blocks_run), _kv_cache_dtype(config, hardware, dtype.value),
                    weights)


def _weights(config: EngineConfig, hardware: Hardware, file_blocks: bool, experts: bool) -> Choice:
    """Whether dense weights are rounded to Q8_0 at load: where the int8 dot kernels run, that is faster than
    16-bit weights at every batch size measured (a 1B model: 1.4-1.9x at one stream, 1.6x at 16 on AVX-512
    BF16; more against float32 on AVX2) and its perplexity stays within 0.5% of the 16-bit model's
    (docs/benchmarks.md, "Dense checkpoints")."""
    if config.quantization is not None:
        return Choice(config.quantization, "--quantization")
    if file_blocks:
        return Choice(AS_STORED, "the file's block-quantized matrices")
    if hardware.device_type != "cpu":
        return Choice(AS_STORED, f"dense weights on {hardware.device_type}")
    if hardware.int8_dot is None or not hardware.cpu_kernels:
        return Choice(AS_STORED, "dense weights; no int8 dot-product kernels on this CPU")
    if config.dtype != "auto" or config.block_matmul == "float32":
        return Choice(AS_STORED, "dense weights, as --dtype / --block-matmul ask")
    if experts:
        return Choice(AS_STORED, "dense weights; the experts of a mixture stay dense, so the model keeps its dtype")
    return Choice("q8_0", f"dense weights rounded to Q8_0 at load for int8 dot products ({hardware.int8_dot}); "
                          "--quantization none keeps them dense")


def _blocks_run(hardware: Hardware, dtype: str) -> bool:
    """Whether block-quantized weights stay so: on CUDA (the triton kernel, any float dtype), or on a CPU with
    the C++ kernels in float32."""
    return hardware.device_type != "cpu" or (hardware.cpu_kernels and dtype == "float32")


def _dtype(config: EngineConfig, hardware: Hardware, block_weights: bool, q8_0: bool) -> Choice:
    if config.dtype != "auto":
        return Choice(config.dtype, "--dtype")
    if hardware.device_type == "cuda":
        return Choice("bfloat16", "CUDA bfloat16") if hardware.cuda_bf16 else Choice("float16", "CUDA without bfloat16")
    if hardware.device_type != "cpu":
        return Choice("float32", f"{hardware.device_type}")
    if block_weights and hardware.cpu_kernels:
        return Choice("float32", "block-quantized weights: the C++ block kernels compute in float32")
    if q8_0:
        return Choice("float32", "Q8_0 weights run on the C++ block kernels, in float32")
    bf16 = hardware.native_bf16
    if bf16 is not None and hardware.cpu_kernels:
        return Choice("bfloat16", f"dense weights, native bfloat16 ({bf16})")
    if bf16 is None:
        return Choice("float32", "dense weights, no native bfloat16 on this CPU")
    return Choice("float32", "dense weights, no C++ kernels to run bfloat16")


def _block_matmul(config: EngineConfig, hardware: Hardware, blocks_run: bool) -> Choice:
    if config.block_matmul != "auto":
        return Choice(config.block_matmul, "--block-matmul")
    if hardware.device_type != "cpu":
        return Choice("float32", f"a CPU option; {hardware.device_type} runs the triton block kernel")
    if not blocks_run:
        return Choice("float32", "no block-quantized weights")
    if hardware.int8_dot is None:
        return Choice("float32", "no SIMD integer dot products on this CPU")
    if hardware.amx and hardware.cpu_kernels:
        # The AMX tile paths (bfloat16-int8) were last measured on 2026-12-04, before the kernels' 12-06 and
        # 12-07 refactors; a default runs the path measured most recently on a CPU kind, so AMX CPUs take the
        # integer dot products until bfloat16-int8 is measured there again (it stays one flag away).
        return Choice("int8", f"{hardware.int8_dot}; AMX CPUs too, until --block-matmul bfloat16-int8 (AMX-BF16 "
                              "tiles for prefill) is measured there again")
    return Choice("int8", hardware.int8_dot)


def _kv_cache_dtype(config: EngineConfig, hardware: Hardware, dtype: str) -> Choice:
    if config.kv_cache_dtype != "auto":
        return Choice(config.kv_cache_dtype, "--kv-cache-dtype")
    if hardware.device_type != "cpu" or dtype != "float32":
        return Choice(dtype, "the model's dtype")
    if not hardware.cpu_kernels:
        return Choice(dtype, "the model's dtype (no C++ kernels to read a 16-bit cache)")
    bf16 = hardware.native_bf16
    if bf16 is not None:
        return Choice("bfloat16", f"16-bit cache under a float32 model, native bfloat16 ({bf16})")
    return Choice("float16", "16-bit cache under a float32 model, no native bfloat16")


def has_experts(hf_config) -> bool:
    """Whether a model has mixture-of-experts layers (Mixtral's num_local_experts, Qwen3-MoE's num_experts)."""
    return bool(getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None))


def detect_hardware(device_type: str, attention_backend: str) -> Hardware:
    """This machine, as the engine will run on it (builds tokenmill's CPU kernels if needed)."""
    if device_type == "cuda":
        import torch

        return Hardware("cuda", cuda_bf16=bool(torch.cuda.is_bf16_supported()))
    if device_type != "cpu":
        return Hardware(device_type)
    from tokenmill.model.layers import cpu_kernels

    flags = frozenset(cpu_kernels.cpu_flags())
    kernels = cpu_kernels.load() if attention_backend in ("auto", "cpu") else None
    if kernels is None:
        return Hardware("cpu", flags)
    from tokenmill.model.layers.linear import runs_int8_dot

    return Hardware("cpu", flags, True, kernels.int8_dot if runs_int8_dot(kernels) else None)
