"""How a model's linear layers run, chosen once when the model is built, as vLLM's `QuantizationConfig` /
`LinearMethodBase` do: dense float weights (oneDNN-packed on CPU), or block-quantized ones (a GGUF's kept
blocks, `--quantization q8_0`) multiplied by tokenmill's C++ kernels in the arithmetic `--block-matmul`
names (float32, int8 dot products, bfloat16 tiles, or both by step size), or by the triton kernel on CUDA.

The runner builds a `LinearMethods` for its model and attention backend, asks it which GGUF matrices to keep
as stored (`keeps_int8_blocks`) or which to round to Q8_0 as they stream in (`rounds_at_load`,
`round_while_loading`) and, once the weights are loaded, has it convert the layers (`apply`); it never looks at
which kernels exist.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from functools import cached_property
from typing import Optional

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.model.layers.linear import (
    BLOCK_KERNEL_MAX_ROWS,
    INT8_DOT_PATHS,
    QUANT_BLOCK,
    Bf16TileInt8RowKernels,
    Bf16TileKernels,
    BlockQuantLinear,
    Int8ActivationKernels,
    Int8Blocks,
    PackedBlocks,
    PackedLinear,
    dense_linear,
    onednn_packing_supported,
    quantize_q8_0,
    runs_bf16_tiles,
    runs_int8_dot,
)

logger = logging.getLogger("tokenmill")

INT8_KERNELS_NEEDED = ("needs the CPU device, dtype float32 and tokenmill's CPU kernels (attention backend 'cpu'), "
                       "or a CUDA device where triton runs")


class PackingBlockStore(dict):
    """The kept blocks of a checkpoint being loaded (checkpoint name -> `Int8Blocks`), each linear layer's
    packed into the kernels' layout the moment its last part arrives, its unpacked parts then dropped: a
    load holds one layer's unpacked integers at a time, not the whole model's (a 4-bit file widened to one
    byte per weight). `packed` maps a module name to its `PackedBlocks`; a name stays `in` the store once
    kept (the model's loader counts it loaded), packed or not."""

    def __init__(self, parts_of: dict[str, list[str]], layout: str, packer=None) -> None:
        """packer: tokenmill's C++ module where it is built (it lays the integers out in one pass)."""
        super().__init__()
        self._packer = packer
        self._parts_of = parts_of
        self._module_of = {part: module for module, parts in parts_of.items() for part in parts}
        self._layout = layout
        self._kept: set[str] = set()
        self.packed: dict[str, PackedBlocks] = {}

    def __bool__(self) -> bool:  # whether anything was kept: emptied as layers pack, it still holds them
        return bool(self._kept)

    def __contains__(self, name: object) -> bool:
        return name in self._kept or dict.__contains__(self, name)

    def __setitem__(self, name: str, blocks: Int8Blocks) -> None:
        super().__setitem__(name, blocks)
        self._kept.add(name)
        module = self._module_of.get(name)
        if module is None or module in self.packed:
            return
        parts = self._parts_of[module]
        if not all(dict.__contains__(self, part) for part in parts):
            return
        self.packed[module] = PackedBlocks.of([self[part] for part in parts], self._layout, self._packer)
        for part in parts:  # each checkpoint matrix is one module's part (a tied head's, not the embedding's)
            dict.pop(self, part)

    def clear(self) -> None:
        super().clear()
        self.packed.clear()


class LinearMethods:
    """The linear layers' methods for one model. kernels: tokenmill's C++ CPU kernels where the model runs on them
    (else None: dense torch layers, or triton's on CUDA); quantization, block_matmul: the engine's (resolved) options;
    packed_linear_rows: the row count oneDNN packs dense weights for (None: no packing); tp: the tensor-parallel
    group when the model is one rank's shard."""

    def __init__(self, model: torch.nn.Module, kernels, device: torch.device, dtype: torch.dtype,
                 quantization: Optional[str], block_matmul: str, packed_linear_rows: Optional[int], tp=None) -> None:
        self.model = model
        self.kernels = kernels
        self.device = device
        self.dtype = dtype
        self.quantization = quantization
        self.block_matmul = block_matmul
        self.packed_linear_rows = packed_linear_rows
        self.tp = tp
        self.packed_linear = False  # dense layers hold oneDNN-packed weights
        self.num_gguf_layers_kept = 0  # linear layers holding a GGUF's own blocks (or blocks rounded at load)
        self._block_matmul_kernels = None  # what --block-matmul runs the block layers with
        # The checkpoint tensors a Q8_0 GGUF would hold in blocks: the linear layers' (named before `apply`
        # converts them), the LM head's and the token embedding.
        self.matrix_names: set[str] = set()
        self.rounded_at_load: set[str] = set()  # what round_while_loading rounded
        if hasattr(model, "checkpoint_weight_names"):
            self.matrix_names = {"model.embed_tokens.weight", *model.checkpoint_weight_names("lm_head")}
            for module_name, module in model.named_modules():
                if isinstance(module, torch.nn.Linear):
                    self.matrix_names.update(model.checkpoint_weight_names(module_name))

    def _int8_kernels(self):
        """tokenmill's C++ kernels when block-int8 layers can run here (CPU backend, float32), else None;
        under `--block-matmul int8` / `bfloat16` wrapped so block matmuls take integer dot products / run
        prefill-sized steps in bfloat16."""
        kernels = self.kernels
        if kernels is None or self.dtype != torch.float32 or not hasattr(self.model, "convert_linear_layers"):
            return None
        if self.block_matmul == "float32":
            return kernels
        if self._block_matmul_kernels is None:  # decided (and warned about) once
            self._block_matmul_kernels = self._block_matmul_wrapper(kernels)
        return self._block_matmul_kernels

    def _block_matmul_wrapper(self, kernels):
        """The kernels `--block-matmul` names where this CPU and torch's MKL can run them; otherwise a
        warning and the nearest that can (for bfloat16-int8, whichever half can; else float32)."""
        int8, bf16 = runs_int8_dot(kernels), runs_bf16_tiles(kernels)
        int8_missing = "needs a CPU with AVX2 (or AVX-512 VNNI and VBMI)"
        bf16_missing = "needs a CPU with AMX-BF16, or AVX-512 BF16 and MKL's bfloat16 GEMM"
        mode = self.block_matmul
        if mode == "bfloat16-int8":
            if int8 and bf16:
                return Bf16TileInt8RowKernels(kernels)
            if int8 or bf16:
                kept, missing, needs = (("int8", "bfloat16", bf16_missing) if int8
                                        else ("bfloat16", "int8", int8_missing))
                logger.warning("--block-matmul bfloat16-int8: %s %s; block-quantized layers multiply as "
                               "--block-matmul %s does", missing, needs, kept)
                mode = kept
        if mode == "int8" and int8:
            return Int8ActivationKernels(kernels)
        if mode == "bfloat16" and bf16:
            return Bf16TileKernels(kernels)
        needs = bf16_missing if mode == "bfloat16" else int8_missing if mode == "int8" else \
            f"{int8_missing} and {bf16_missing}"
        logger.warning("--block-matmul %s %s; block-quantized layers multiply in float32", mode, needs)
        return kernels

    @cached_property
    def block_kernels(self):
        """What runs block-quantized layers here, or None (they are then dequantized at load): on CUDA the
        Triton dequantize-and-matmul, where triton imports and the kernel passes a start-up check in the
        model's dtype; elsewhere tokenmill's C++ kernels (`_int8_kernels`). Decided once; logged."""
        if self.device.type != "cuda":
            return self._int8_kernels()
        if self.block_matmul != "float32":
            logger.warning("--block-matmul %s is a CPU option; on %s block-quantized layers run the triton "
                           "kernel in %s", self.block_matmul, self.device, str(self.dtype).removeprefix("torch."))
        if not hasattr(self.model, "convert_linear_layers"):
            return None
        from tokenmill.model.layers.triton_quant_linear import load_triton_block_kernels

        kernels, reason = load_triton_block_kernels(self.device, self.dtype)
        if kernels is None:
            logger.info("block-quantized weights: the triton kernel cannot run (%s); GGUF blocks are "
                        "dequantized to %s at load", reason, str(self.dtype).removeprefix("torch."))
        return kernels

    def _runs_cpu_kernels(self, kernels) -> bool:
        return kernels is not None and kernels is self._int8_kernels()

    def keeps_int8_blocks(self, is_gguf: bool) -> bool:
        """Whether loading keeps a GGUF's block-quantized matrices as stored: `--quantization gguf`, and by
        default for GGUF files wherever `block_kernels` run (as vLLM and llama.cpp serve a GGUF in its own
        quantization). The values are the file's, bit for bit; only the summation order differs from a
        dense float32 copy (and, on CUDA, the final rounding to the model's dtype)."""
        if self.quantization == "gguf":
            if not is_gguf:
                raise ModelLoadError("--quantization gguf needs a GGUF model file")
            if self.block_kernels is None:
                raise ModelLoadError(f"--quantization gguf {INT8_KERNELS_NEEDED}")
            return True
        return self.quantization is None and is_gguf and self.block_kernels is not None

    def rounds_at_load(self, is_gguf: bool) -> bool:
        """Whether matrices are rounded to Q8_0 as the checkpoint streams in (one process, the C++ or triton
        kernels to run them), so the model never holds a float copy of them: every matrix under `--quantization
        q8_0`, and a GGUF's matrices in types the blocks cannot hold as stored (Q6_K, F16) where activations are
        rounded to int8 anyway. A tensor-parallel rank rounds its shards after loading instead."""
        if self.tp is not None or self.block_kernels is None:
            return False
        if self.quantization == "q8_0":
            return True
        return self.keeps_int8_blocks(is_gguf) and getattr(self.block_kernels, "int8_activations", False)

    def block_store(self) -> dict[str, Int8Blocks]:
        """Where loading puts the matrices it keeps in blocks: a `PackingBlockStore` that packs each layer as
        its parts arrive, for one process's whole model (a tensor-parallel rank slices its blocks after
        loading, so it gets a plain dict)."""
        if self.tp is not None or not hasattr(self.model, "checkpoint_weight_names") or self.block_kernels is None:
            return {}
        modules = [name for name, module in self.model.named_modules() if isinstance(module, torch.nn.Linear)]
        if getattr(self.model, "lm_head", True) is None:  # tied: the head is converted from the embedding
            modules.append("lm_head")
        parts_of = {module: self.model.checkpoint_weight_names(module) for module in modules}
        return PackingBlockStore(parts_of, getattr(self.block_kernels, "weight_layout", "rows"), self.kernels)

    def round_while_loading(self, weights: Iterable[tuple[str, torch.Tensor]],
                            int8_blocks: dict[str, Int8Blocks]) -> Iterator[tuple[str, torch.Tensor]]:
        """`weights` with each projection matrix (the LM head and the token embedding included, as a Q8_0
        GGUF holds them) rounded to Q8_0 into `int8_blocks` and passed on as a shape-only `meta` tensor, which
        the model counts as loaded without writing its float parameter. Matrices whose inputs are not whole
        32-value blocks pass on as they are (those layers stay dense)."""
        for name, tensor in weights:
            if name in self.matrix_names and tensor.dim() == 2 and tensor.shape[1] % QUANT_BLOCK == 0 \
                    and tensor.device.type != "meta":
                int8_blocks[name] = Int8Blocks(*quantize_q8_0(tensor))
                self.rounded_at_load.add(name)
                tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            yield name, tensor

    def apply(self, int8_blocks: Optional[dict[str, Int8Blocks]] = None) -> str:
        """Builds every linear layer of the model (its weights loaded; `int8_blocks`: the checkpoint matrices
        kept in block-int8 form, emptied as the layers take them) and returns how they run."""
        convertible = hasattr(self.model, "convert_linear_layers")
        rows = self.packed_linear_rows or 64
        kernels = self.block_kernels
        device = None if self.device.type == "cpu" else self.device  # where the packed tensors live
        if self.quantization == "q8_0" and not int8_blocks:  # a tensor-parallel shard: rounded here
            if kernels is None:
                raise ModelLoadError(f"--quantization q8_0 {INT8_KERNELS_NEEDED}")
            def make_q8_0(name: str, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.nn.Module:
                if weight.shape[1] % QUANT_BLOCK:
                    # Inputs that do not fill whole 32-value blocks (a small model's width, or a row-parallel
                    # shard of one).
                    logger.info("%s: %d input features are not whole Q8_0 blocks; the layer stays dense",
                                name, weight.shape[1])
                    return dense_linear(weight, bias, self.packed_linear_rows)
                return BlockQuantLinear.from_weight(weight, bias, kernels, device)

            self.model.convert_linear_layers(make_q8_0)
            return ("Q8_0 weights rounded at load (" + self._block_kernel_paths(kernels)
                    + self._enable_int8_decode(kernels))
        if int8_blocks:
            widths: dict[int, int] = {}
            requantized: list[str] = []
            # Where activations are rounded to int8 already (--block-matmul int8, bfloat16-int8), a matrix whose
            # GGUF type Int8Blocks cannot hold as stored (Q6_K/Q3_K/Q2_K use runs of 16, F16) is rounded to
            # Q8_0 (per 32 inputs): an 8-bit grid over at most 6-bit values, for the int8 kernels' speed and a
            # quarter of the float32 copy's memory. Elsewhere (exact float32) it stays dense.
            requantize = getattr(kernels, "int8_activations", False)

            def make(name: str, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.nn.Module:
                names = self.model.checkpoint_weight_names(name)
                packed = getattr(int8_blocks, "packed", {}).pop(name, None)
                parts = [packed] if packed is not None else [int8_blocks.get(part) for part in names]
                if all(part is not None for part in parts):
                    if self.rounded_at_load.intersection(names) and self.quantization != "q8_0":
                        requantized.append(name)
                    self.num_gguf_layers_kept += 1
                    layer = BlockQuantLinear(Int8Blocks.cat(parts) if len(parts) > 1 else parts[0], bias, kernels,
                                             device)
                    if name != "lm_head":  # each layer's blocks freed once packed (the head's may be the embedding's)
                        for part in names:
                            int8_blocks.pop(part, None)
                    widths[layer.bits] = widths.get(layer.bits, 0) + 1
                    return layer
                # A matrix GGUF blocks do not cover (a Q6_K head, an F16 projection) stays dense; parts of it
                # that are blocks were not copied at load: their rows are the blocks' values.
                offset = 0
                for part, rows in zip(parts, self.model.checkpoint_part_rows(name)):
                    if part is not None:
                        weight.data[offset:offset + rows].copy_(part.dequantize())
                    offset += rows
                if requantize and weight.shape[1] % QUANT_BLOCK == 0:
                    requantized.append(name)
                    return BlockQuantLinear.from_weight(weight, bias, kernels, device)
                return dense_linear(weight, bias, self.packed_linear_rows)

            self.model.convert_linear_layers(make)
            embedded = self.model.keep_embedding_blocks(int8_blocks.get("model.embed_tokens.weight"), kernels)
            embedding = "; embeddings read from the blocks" if embedded else ""
            int8_blocks.clear()  # the layers hold their packed copies now
            kept = ", ".join(f"{count} at {bits} bits" for bits, count in sorted(widths.items()))
            if requantized:
                kept += f", {len(requantized)} rounded to Q8_0 at load"
            if self.quantization == "q8_0":
                read = "embeddings read from the blocks; " if embedded else ""
                return (f"Q8_0 weights rounded as they loaded in {self.num_gguf_layers_kept} layers ({read}"
                        + self._block_kernel_paths(kernels) + self._enable_int8_decode(kernels))
            return (f"GGUF weights kept quantized in {self.num_gguf_layers_kept} layers ({kept}{embedding}; "
                    + self._block_kernel_paths(kernels)
                    + self._enable_int8_decode(kernels))
        if self.block_matmul != "float32":
            logger.warning("--block-matmul %s applies to block-quantized weights (a GGUF's kept blocks, "
                           "--quantization q8_0); this model's projections multiply in %s", self.block_matmul,
                           str(self.dtype).removeprefix("torch."))
        if self.quantization == "gguf":
            raise ModelLoadError("--quantization gguf: the file has no matrices in a type kept quantized "
                                 "(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K)")
        if (self.packed_linear_rows and self.device.type == "cpu" and onednn_packing_supported(self.dtype)
                and convertible):
            self.model.convert_linear_layers(lambda name, weight, bias: PackedLinear(weight, bias, rows))
            self.packed_linear = True
            return "oneDNN packed weights"
        return "torch F.linear"

    @staticmethod
    def _bf16_tile_path(kernels) -> str:
        return {"amx": "into AMX tiles (TDPBF16PS)", "mkl": "through MKL's bfloat16 GEMM"}.get(
            kernels.bf16_tiles(), "through at::mm")

    def _block_kernel_paths(self, kernels) -> str:
        if not self._runs_cpu_kernels(kernels):
            return f"triton dequantize-and-matmul on {self.device}, no float copy"
        if isinstance(kernels, Bf16TileInt8RowKernels):
            path = INT8_DOT_PATHS[kernels.int8_dot]
            return (f"steps of up to {BLOCK_KERNEL_MAX_ROWS} rows with activations rounded to int8 per block of 32 "
                    f"and {path} integer dot products, tiles rounded to bfloat16 {self._bf16_tile_path(kernels)} "
                    "above, no float copy")
        if getattr(kernels, "int8_activations", False):
            path = INT8_DOT_PATHS.get(getattr(kernels, "int8_dot", ""), "portable")
            return (f"activations rounded to int8 per block of 32, {path} integer dot products on weights kept in "
                    "their layout, no float copy")
        if isinstance(kernels, Bf16TileKernels):
            return (f"row kernel for steps of up to {BLOCK_KERNEL_MAX_ROWS} rows, tiles rounded to bfloat16 "
                    f"{self._bf16_tile_path(kernels)} above, no float copy")
        return (f"row kernel for steps of up to {BLOCK_KERNEL_MAX_ROWS} rows, dequantized tiles through sgemm "
                "above, no float copy")

    def _enable_int8_decode(self, kernels) -> str:
        if not self._runs_cpu_kernels(kernels):
            return ")"
        fused = getattr(self.model, "enable_int8_decode", lambda _: False)(kernels)
        if not fused:
            return ")"
        if getattr(self.model, "fused_stack_prefills", False):
            return "; decode and prefill steps run the decoder stack in one C++ call)"
        return f"; decode steps of up to {BLOCK_KERNEL_MAX_ROWS} rows run the decoder stack in one C++ call)"

