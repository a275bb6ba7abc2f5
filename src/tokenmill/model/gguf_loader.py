"""GGUF files: config from metadata, dequantized weights under HF names, tokenizer via transformers.

A GGUF file stores what llama.cpp needs, in llama.cpp's layout. Three things differ from an HF
checkpoint and are undone here:
  * names  (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
  * shapes (GGUF lists dimensions innermost first: `[ne0, ne1]` = `[in_features, out_features]`);
  * the rows of q_proj / k_proj, which llama.cpp's converter reorders for its interleaved rotary
    layout (see `unpermute_rotary_rows`).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.errors import ModelLoadError
from tokenmill.model import tokenizer_cache
from tokenmill.model.gguf_families import (
    GGUF_FAMILIES,
    LLAMA_WITH_EXPERTS,
    GgufFamily,
    block_tensor_names,
    family_settings,
)
from tokenmill.model.layers.linear import Int8Blocks, quantize_q8_0
from tokenmill.model.mapped_pages import release_mapped_pages

if TYPE_CHECKING:
    import gguf
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


# Quantization types gguf-py dequantizes in numpy. The common set is F32/F16/BF16/Q8_0/
# Q4_0/Q4_1/Q4_K/Q6_K; the other legacy and k-quants are included because "Q5_K_M"/"Q3_K_M"
# files mix them and gguf-py handles them with the same code path.
SUPPORTED_TENSOR_TYPES: frozenset[str] = frozenset(
    {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)

_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors that carry no HF parameter: llama3 and LongRoPE rope factors are folded into the config instead.
_NON_PARAMETER_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


def open_gguf(path: Path) -> gguf.GGUFReader:
    from tokenmill.model.gguf_reader import FastGGUFReader

    try:
        return FastGGUFReader(path)  # memory-maps the file; tensors are read on demand
    except Exception as exc:  # a truncated or foreign file raises anything from ValueError to struct.error
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None


def gguf_architecture(reader: gguf.GGUFReader, path: Path) -> tuple[str, GgufFamily]:
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path} has no general.architecture metadata")
    family = GGUF_FAMILIES.get(arch)
    if arch == "llama" and (_field(reader, "llama.expert_count") or 0) > 0:
        family = LLAMA_WITH_EXPERTS
    if family is None:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} in {path.name} (supported: {', '.join(sorted(GGUF_FAMILIES))})"
        )
    return arch, family


def gguf_hf_name(gguf_name: str, block_names: dict[str, str] | None = None) -> str | None:
    """HF parameter name for a GGUF tensor name (block tensors per `block_names`, Llama's by default);
    None when the name is unknown."""
    block_names = block_tensor_names() if block_names is None else block_names
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_TENSOR_NAMES:
        return f"{_GLOBAL_TENSOR_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block_names:
        return f"model.layers.{int(parts[1])}.{block_names[parts[2]]}.{suffix}"
    return None


def read_gguf_config(reader: gguf.GGUFReader, path: Path) -> tuple[PretrainedConfig, str]:
    """The transformers config and HF architecture name described by the file's metadata."""
    import transformers

    arch, family = gguf_architecture(reader, path)

    def required(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path.name} lacks the metadata key {arch}.{key}")
        return value

    tensor_names = {t.name for t in reader.tensors}
    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv")
    head_dim = _field(reader, f"{arch}.attention.key_length")
    rope_theta = float(_field(reader, f"{arch}.rope.freq_base") or 10000.0)
    settings: dict[str, Any] = dict(
        architectures=[family.hf_architecture],
        vocab_size=_vocab_size(reader, arch, path),
        hidden_size=hidden,
        intermediate_size=int(required("feed_forward_length")),
        num_hidden_layers=int(required("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads) if kv_heads is not None else heads,
        head_dim=int(head_dim) if head_dim is not None else hidden // heads,
        max_position_embeddings=int(required("context_length")),
        rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
        rope_parameters=_rope_parameters(reader, arch, rope_theta, path),
        # llama.cpp omits output.weight exactly when the head reuses the embedding matrix
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    family_settings(arch, settings, lambda key: _field(reader, f"{arch}.{key}"), reader.tensors, path)
    end_of_turn = _token_id(reader, family.end_of_turn_token)
    if end_of_turn is not None and settings["eos_token_id"] not in (None, end_of_turn):
        settings["eos_token_id"] = [settings["eos_token_id"], end_of_turn]
    config_class = getattr(transformers, family.config_class_name)
    return config_class(**settings), family.hf_architecture


@dataclass
class Q8_0Rounding:
    """Matrices to round to Q8_0 as they load (`names`: HF names), and the names rounded so far."""

    names: Container[str]
    rounded: set[str] = field(default_factory=set)


def iter_gguf_weights(
    path: Path, config: PretrainedConfig, dtype: torch.dtype, reader: gguf.GGUFReader | None = None,
    int8_blocks: dict[str, Int8Blocks] | None = None, dense_kept: bool = False,
    rounding: Q8_0Rounding | None = None, kernels: ModuleType | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, tensor) one tensor at a time, dequantized and in HF layout.

    Pass the reader that read the config to skip a second parse of the header (seconds for a
    50k-token vocabulary: gguf-py builds a numpy view per metadata array element). Matrices in a type
    `Int8Blocks` represents (INT8_BLOCK_TYPES) are decoded by `gguf_int8_blocks` and dequantized from
    those blocks, which reproduces gguf-py's values bit for bit (tests/model/test_gguf_int8.py) in a
    fraction of its time; other types go through gguf-py. With `int8_blocks` (float32 only), such a
    matrix is put there under its HF name and yielded as a shape-only `meta` tensor, for a consumer
    that skips the names it finds there, unless `dense_kept` asks for its dense values too. With `rounding`
    too, the matrices it names in other types (Q6_K, F16, ...) are rounded to Q8_0 into `int8_blocks` a run
    of rows at a time, never held dense, and yielded as `meta` tensors.

    `kernels` (tokenmill's C++ module, where it is built) decodes Q4_K and Q6_K matrices in one pass each,
    to the same values. Each tensor's pages of the mapped file are released once it is read: they stay in the page
    cache, but not in this process's resident memory beside the weights built from them.
    """
    from gguf import quants

    reader = reader if reader is not None else open_gguf(path)
    _, family = gguf_architecture(reader, path)
    keep = int8_blocks is not None and dtype == torch.float32
    for tensor in reader.tensors:
        if tensor.name in _NON_PARAMETER_TENSORS:
            continue
        hf_name = gguf_hf_name(tensor.name, family.block_names)
        if hf_name is None:
            raise ModelLoadError(f"unexpected tensor {tensor.name!r} in {path.name}")
        type_name = tensor.tensor_type.name
        if type_name not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"tensor {tensor.name} in {path.name} uses the unsupported GGUF type {type_name}"
            )
        # GGUF shape [ne0, ne1] is innermost-first; torch wants [ne1, ne0] = [out, in].
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        unpermute = None
        if family.unpermute_qk and ".attn_q." in tensor.name:
            unpermute = config.num_attention_heads
        elif family.unpermute_qk and ".attn_k." in tensor.name:
            unpermute = config.num_key_value_heads
        blocks = gguf_int8_blocks(tensor, kernels)
        if blocks is None and keep and not dense_kept and rounding is not None and hf_name in rounding.names \
                and len(shape) == 2 and shape[1] % 32 == 0:
            blocks = _rounded_to_q8_0(tensor, shape, kernels)
            rounding.rounded.add(hf_name)
        if blocks is not None:
            _release_pages(tensor)  # the blocks hold their own copy
            if unpermute is not None:
                blocks = blocks.map_rows(lambda rows: unpermute_rotary_rows(rows, unpermute))
        if blocks is not None and keep:
            int8_blocks[hf_name] = blocks
            if not dense_kept:
                yield hf_name, torch.empty(shape, dtype=dtype, device="meta")
                continue
        if blocks is not None:
            weight = blocks.dequantize()
        else:
            dequantize = _DEQUANTIZERS.get(type_name)
            array = (quants.dequantize(tensor.data, tensor.tensor_type) if dequantize is None
                     else _in_chunks(dequantize, _raw_blocks(tensor), 256)).reshape(shape)
            # Unquantized tensors come back as read-only memmap views; torch needs its own copy.
            weight = torch.from_numpy(np.array(array, copy=not array.flags.writeable))
            if unpermute is not None:
                weight = unpermute_rotary_rows(weight, unpermute)
            del array
            _release_pages(tensor)
        weight = weight.to(dtype)
        if family.norm_offset and tensor.name.endswith("norm.weight"):
            weight = weight - family.norm_offset
        yield hf_name, weight.contiguous()
        del weight, blocks  # keep at most one tensor alive between yields


# ---- GGUF blocks kept as block-int8 --------------------------------------------------------------
# Types whose values are q * scale (+ min) per run of 32 inputs with |q| < 128: the int8 kernel runs them
# as stored (tokenmill.model.layers.linear.Int8Blocks). Q2_K/Q3_K/Q6_K use runs of 16: they load dense, and
# under int8 dot products LinearMethods rounds them to Q8_0.
INT8_BLOCK_TYPES: frozenset[str] = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K"})


def has_int8_block_matrices(reader: gguf.GGUFReader) -> bool:
    return any(tensor.tensor_type.name in INT8_BLOCK_TYPES and len(tensor.shape) == 2 for tensor in reader.tensors)


def gguf_int8_blocks(tensor: Any, kernels: ModuleType | None = None) -> Int8Blocks | None:
    """The tensor's integers and per-32 scales/mins as stored in the file; None for other types.

    Rows are the GGUF's (output features); q/k rows are not yet unpermuted. `kernels`: tokenmill's C++
    module, which decodes Q4_K (the type most downloads hold) in one pass.
    """
    from gguf import GGML_QUANT_SIZES

    type_name = tensor.tensor_type.name
    if type_name not in INT8_BLOCK_TYPES or len(tensor.shape) != 2:
        return None
    in_features, out_features = (int(d) for d in tensor.shape.tolist())
    if kernels is not None and type_name == "Q4_K":
        q, scales, mins = kernels.unpack_q4_k(_mapped_tensor(_raw_blocks(tensor)))
        return Int8Blocks(q.view(out_features, in_features), scales.view(out_features, in_features // 32),
                          mins.view(out_features, in_features // 32))
    block_size, _ = GGML_QUANT_SIZES[tensor.tensor_type]
    raw = _raw_blocks(tensor)
    unpack = _UNPACKERS[type_name]
    has_mins = type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
    per_block = block_size // 32  # 32-value sub-blocks per block
    q = np.empty((len(raw), block_size), dtype=np.int8)
    scales = np.empty((len(raw), per_block), dtype=np.float32)
    mins = np.empty_like(scales) if has_mins else None
    # A few thousand blocks at a time: numpy's intermediates stay in cache instead of streaming whole
    # matrices through memory once per operation (several times faster on a multi-GB file).
    step = _CHUNK_VALUES // block_size
    for start in range(0, len(raw), step):
        part = slice(start, start + step)
        q_part, scale_part, min_part = unpack(raw[part])
        q[part] = q_part.reshape(-1, block_size)
        scales[part] = scale_part.reshape(-1, per_block)
        if mins is not None:
            mins[part] = min_part.reshape(-1, per_block)
    subblocks = in_features // 32
    return Int8Blocks(
        torch.from_numpy(q.reshape(out_features, in_features)),
        torch.from_numpy(scales.reshape(out_features, subblocks)),
        None if mins is None else torch.from_numpy(mins.reshape(out_features, subblocks)),
    )


def _rounded_to_q8_0(tensor: Any, shape: tuple[int, ...], kernels: ModuleType | None = None) -> Int8Blocks:
    """A matrix in a type not kept as stored, rounded to Q8_0 (`quantize_q8_0`) a run of rows at a time: its
    float32 values exist for those rows only (an 8B model's Q6_K head is 2 GB as float32). `kernels`:
    tokenmill's C++ module, which rounds Q6_K (Q4_K_M's six-bit matrices) in one pass, to the same bytes."""
    from gguf import quants

    out_features, in_features = shape
    if kernels is not None and tensor.tensor_type.name == "Q6_K":
        q, scales = kernels.q6_k_to_q8_0(_mapped_tensor(_raw_blocks(tensor)))
        return Int8Blocks(q.view(out_features, in_features), scales.view(out_features, in_features // 32))
    rows_data = np.asarray(tensor.data).reshape(out_features, -1)  # one row of values or blocks each
    dequantize = _DEQUANTIZERS.get(tensor.tensor_type.name)
    block_bytes = _raw_blocks(tensor).shape[1] if dequantize is not None else 0
    q = torch.empty(out_features, in_features, dtype=torch.int8)
    scales = torch.empty(out_features, in_features // 32)
    step = max(1, _CHUNK_VALUES // in_features)
    for start in range(0, out_features, step):
        part = rows_data[start:start + step]
        if dequantize is not None:
            values = _in_chunks(dequantize, part.view(np.uint8).reshape(-1, block_bytes), 256)
        else:
            values = quants.dequantize(part, tensor.tensor_type)
        q[start:start + step], scales[start:start + step] = quantize_q8_0(
            torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(len(part), in_features)))
    return Int8Blocks(q, scales)


def _mapped_tensor(array: np.ndarray) -> torch.Tensor:
    """A read-only view of the mapped file as a tensor, for kernels that only read it (torch warns that it
    cannot make such a buffer writable; nothing writes to it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(array))


def _release_pages(tensor: Any) -> None:
    """Drops the tensor's pages of the file mapping from this process's resident set."""
    data = np.asarray(tensor.data)
    if data.flags.c_contiguous:
        release_mapped_pages(data.ctypes.data, data.nbytes)


# Values decoded per numpy pass: their int16/float32 intermediates fit in L2.
_CHUNK_VALUES = 1 << 19


def _raw_blocks(tensor: Any) -> np.ndarray:
    """The tensor's blocks as rows of bytes [blocks, bytes per block] (a view of the mapped file)."""
    from gguf import GGML_QUANT_SIZES

    _, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    return np.asarray(tensor.data).view(np.uint8).reshape(-1, type_size)


def _in_chunks(dequantize, raw: np.ndarray, block_size: int) -> np.ndarray:
    """dequantize(raw blocks) -> float32 [blocks, block_size], computed a cache-sized run of blocks at a time."""
    out = np.empty((len(raw), block_size), dtype=np.float32)
    step = _CHUNK_VALUES // block_size
    for start in range(0, len(raw), step):
        out[start:start + step] = dequantize(raw[start:start + step])
    return out


def _f16(raw: np.ndarray, offset: int) -> np.ndarray:
    return raw[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles are values 0-15, the high nibbles 16-31 (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes (a little-endian uint32) -> bit i of it for value i, as 16."""
    bits = qh.copy().view("<u4").reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.int16)


def _unpack_q8_0(raw):
    return raw[:, 2:34].copy().view(np.int8), _f16(raw, 0), None


def _unpack_q4_0(raw):
    return _nibbles(raw[:, 2:18]) - 8, _f16(raw, 0), None


def _unpack_q4_1(raw):
    return _nibbles(raw[:, 4:20]), _f16(raw, 0), _f16(raw, 2)


def _unpack_q5_0(raw):
    return (_nibbles(raw[:, 6:22]) | _fifth_bits(raw[:, 2:6])) - 16, _f16(raw, 0), None


def _unpack_q5_1(raw):
    return _nibbles(raw[:, 8:24]) | _fifth_bits(raw[:, 4:8]), _f16(raw, 0), _f16(raw, 2)


def _k_quant_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks of 256: per sub-block of 32, scale d * sc and min -(dmin * m)."""
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    packed = raw[:, 4:16].reshape(-1, 3, 4)
    low, high, mixed = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=-1).astype(np.float32)
    m = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=-1).astype(np.float32)
    return d[:, None] * sc, -(dmin[:, None] * m)


def _k_quant_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 values: each 32 bytes hold two sub-blocks, low nibbles first."""
    qs = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(-1, 256).astype(np.int16)


def _unpack_q4_k(raw):
    scales, mins = _k_quant_scales(raw)
    return _k_quant_nibbles(raw[:, 16:144]), scales, mins


def _unpack_q5_k(raw):
    scales, mins = _k_quant_scales(raw)
    qh = raw[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    fifth = ((qh & 1).reshape(-1, 256) << 4).astype(np.int16)
    return _k_quant_nibbles(raw[:, 48:176]) | fifth, scales, mins


def _dequantize_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks of 256 (ggml's layout: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8
    sub-block scales, a float16 d) -> float32 values d * scale * (q - 32), per sub-block of 16, in ggml's
    order; the same values as gguf-py's, in a fraction of its time."""
    n = len(raw)
    low = raw[:, :128].reshape(n, 2, 64)
    low = np.concatenate([low & 0x0F, low >> 4], axis=-1).reshape(n, 2, 4, 32)
    high = (raw[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).view(np.int8) - np.int8(32)
    scales = raw[:, 192:208].view(np.int8).astype(np.float32) * _f16(raw, 208)[:, None]
    return (q.reshape(n, 16, 16).astype(np.float32) * scales[:, :, None]).reshape(n, 256)


# Types that load dense, decoded here rather than by gguf-py (whose per-row passes took seconds per GB).
_DEQUANTIZERS = {"Q6_K": _dequantize_q6_k}

_UNPACKERS = {"Q8_0": _unpack_q8_0, "Q4_0": _unpack_q4_0, "Q4_1": _unpack_q4_1, "Q5_0": _unpack_q5_0,
              "Q5_1": _unpack_q5_1, "Q4_K": _unpack_q4_k, "Q5_K": _unpack_q5_k}


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row reordering so HF's rotate_half rotary applies.

    HF rotary pairs dimension j with j + d/2 inside each head (two halves); llama.cpp's rope pairs
    2j with 2j+1 (interleaved). Its converter therefore moves HF row (half, j) to GGUF row (j, half):

        HF   rows of one head:  x0 x1 .. x{d/2-1} | y0 y1 .. y{d/2-1}     (view [2, d/2])
        GGUF rows of one head:  x0 y0 x1 y1 .. x{d/2-1} y{d/2-1}           (view [d/2, 2])

    The inverse views each GGUF head as [d/2, 2] and transposes back to [2, d/2].
    Works for weights [heads*d, in] and biases [heads*d].
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"cannot unpermute {rows} rows into {num_heads} rotary heads")
    half = rows // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Tokenizer and chat template from the GGUF's tokenizer.* metadata (transformers rebuilds it; the
    result is kept in tokenizer_cache for the next load of the same file)."""
    from transformers import AutoTokenizer

    cached = tokenizer_cache.load(path)
    if cached is not None:
        return cached
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as exc:  # transformers raises many types for missing/odd tokenizer metadata
        raise ModelLoadError(f"cannot build a tokenizer from {path.name}: {exc}".splitlines()[0]) from None
    tokenizer_cache.store(path, tokenizer)
    return tokenizer


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    if len(field.types) == 1 and field.types[0].name == "FLOAT32":
        # A float32 1e-5 reads back as 9.99999974e-06; the shortest float32 repr restores the
        # value the converter was given, so configs compare equal to the HF originals.
        value = float(str(np.float32(value)))
    return value


def _token_id(reader: gguf.GGUFReader, token: str | None) -> int | None:
    """The id of `token` in the file's vocabulary (tokenizer.ggml.tokens), None when absent."""
    tokens = reader.fields.get("tokenizer.ggml.tokens") if token is not None else None
    if tokens is None:
        return None
    wanted = token.encode()
    # Special tokens sit near the start of the vocabulary; stop at the first match.
    return next((i for i, part in enumerate(tokens.data) if bytes(tokens.parts[part]) == wanted), None)


def _vocab_size(reader: gguf.GGUFReader, arch: str, path: Path) -> int:
    # Newer converters write {arch}.vocab_size; older ones only the token list; files without
    # tokenizer metadata still have the embedding matrix, whose row count is the vocabulary.
    value = _field(reader, f"{arch}.vocab_size")
    if value is not None:
        return int(value)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[1])
    raise ModelLoadError(f"cannot tell the vocabulary size of {path.name}")


def _rope_parameters(reader: gguf.GGUFReader, arch: str, theta: float, path: Path) -> dict[str, Any]:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind in (None, "none"):
        rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        if rope_freqs is not None:
            return _llama3_rope_parameters(np.asarray(rope_freqs.data, dtype=np.float64), theta, path)
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    if kind == "yarn" and factor is not None:
        params: dict[str, Any] = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor)}
        if original is not None:
            params["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = _field(reader, f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                params[hf_key] = float(value)
        return params
    raise ModelLoadError(f"unsupported rope scaling {kind!r} (factor {factor}) in {path.name}")


def _llama3_rope_parameters(factors: np.ndarray, theta: float, path: Path) -> dict[str, Any]:
    """Recover HF's llama3 rope parameters from the per-frequency divisors llama.cpp stores.

    The converter bakes (factor, low_freq_factor, high_freq_factor, original context) into one
    divisor per rotary frequency. Published Llama 3.x models all use low=1, high=4, original=8192
    with the largest divisor as `factor`, so that candidate is rebuilt and compared; anything else
    is refused rather than silently run with the wrong positions.
    """
    candidate = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rotary_dim = 2 * len(factors)
    freqs = theta ** -(np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    wavelen = 2 * math.pi / freqs
    low_wavelen = candidate["original_max_position_embeddings"] / candidate["low_freq_factor"]
    high_wavelen = candidate["original_max_position_embeddings"] / candidate["high_freq_factor"]
    smooth = (candidate["original_max_position_embeddings"] / wavelen - 1.0) / (4.0 - 1.0)
    expected = np.where(
        wavelen < high_wavelen,
        1.0,
        np.where(wavelen > low_wavelen, candidate["factor"], 1.0 / ((1 - smooth) / candidate["factor"] + smooth)),
    )
    if not np.allclose(expected, factors, rtol=1e-3):
        raise ModelLoadError(f"unrecognized rope_freqs tensor in {path.name}: cannot map it to HF rope scaling")
    return candidate
