"""The triton attention backend: paged decode and prefill kernels in Triton, for CUDA devices.

Decodes are attended through block tables + context lengths, prefill chunks through a padded table of
their blocks, cut into query tiles (`PrefillTables`); `prepare_metadata` builds both once per step, on the
device, for every layer. The kernels themselves live in `triton_kernels.py`, imported when the backend is
built, so tokenmill imports without triton.

On the CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1 before the first
import of triton's jit), which is how the tests check them on machines without a GPU. NumPy, which
the interpreter computes with, has no bfloat16, so there every tile is widened to float32 first; on a
GPU 16-bit K/V meet 16-bit queries in the tensor cores with float32 accumulation.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from tokenmill.model.layers.attention.base import AttentionInputs, AttentionMetadata
from tokenmill.model.layers.kv_write import write_kv
from tokenmill.model.layers.paged_tables import padded_block_table

# Keys per split of a decode, and the most splits of one row. Split-K pays off when a batch has too few
# (row, KV head) programs to fill the GPU; these defaults are unmeasured starting points.
DECODE_SPLIT_TOKENS = 512
DECODE_MAX_SPLITS = 16
DECODE_BLOCK_N = 32
PREFILL_BLOCK_M = 64  # query tile rows: BLOCK_Q tokens x the padded group of query heads
PREFILL_BLOCK_N = 32


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the triton backend cannot run on `device`, or None when it can."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"triton is not installed ({error}); it ships with CUDA builds of torch"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        return "it needs a CUDA device (on the CPU it runs only under Triton's interpreter, TRITON_INTERPRET=1)"
    return None


@dataclass
class PrefillTables:
    """One step's prefill chunks as kernel inputs, cut into query tiles of block_q tokens."""

    block_table: torch.Tensor  # [num_chunks, max_blocks] int32, padded with 0
    query_starts: torch.Tensor  # [num_chunks + 1] int32: chunk i is tokens [starts[i], starts[i+1]) of the batch
    context_lens: torch.Tensor  # [num_chunks] int32, incl. the chunk
    tile_requests: torch.Tensor  # [num_tiles] int32: the chunk of each query tile
    tile_offsets: torch.Tensor  # [num_tiles] int32: the tile's first query within its chunk
    block_q: int


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, on the device
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    prefill_tables: dict[int, PrefillTables] = field(default_factory=dict)  # by block_q (the model's head group)

    def prefill_tables_for(self, block_q: int) -> PrefillTables:
        """The step's prefill tables for query tiles of block_q tokens (every layer of a model has the same)."""
        if block_q not in self.prefill_tables:
            self.prefill_tables[block_q] = build_prefill_tables(self, block_q, self.slot_mapping.device)
        return self.prefill_tables[block_q]


def build_prefill_tables(meta: AttentionMetadata, block_q: int, device: torch.device) -> PrefillTables:
    ranges = meta.prefill_query_ranges
    # Consecutive in the flat batch (prefills follow the decodes in order), so starts + one end suffice.
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), "prefill chunks must be contiguous"
    table = padded_block_table(meta.prefill_block_ids, device)
    tiles = [(req, offset) for req, (start, end) in enumerate(ranges) for offset in range(0, end - start, block_q)]
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    return PrefillTables(table, as_int32([start for start, _ in ranges] + [ranges[-1][1]]),
                         as_int32(meta.prefill_context_lens), as_int32([req for req, _ in tiles]),
                         as_int32([offset for _, offset in tiles]), block_q)


@dataclass(frozen=True, slots=True)
class _LaunchArgs:
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    head_dim_p: int  # padded to a power of two, at least 16 (tl.dot's smallest)
    softcap: float  # 0.0: none
    window: int  # 0: none
    block_size: int
    cache_strides: tuple[int, int, int]  # block, token, KV head (in elements)
    constexprs: dict


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (n - 1).bit_length())


class TritonAttentionBackend:
    """Writes the step's K/V with index_copy, then attends through the Triton kernels."""

    name = "triton"
    paged_decode = True
    kernels = None  # tokenmill's C++ CPU kernels: never under this backend

    def __init__(self, split_tokens: int = DECODE_SPLIT_TOKENS, max_splits: int = DECODE_MAX_SPLITS,
                 num_sms: int | None = None) -> None:
        from tokenmill.model.layers.attention import triton_kernels

        self._kernels = triton_kernels
        self.split_tokens = split_tokens
        self.max_splits = max_splits
        # Streaming multiprocessors of the GPU: splitting stops once (rows x KV heads) programs fill them twice.
        self.num_sms = num_sms

    def describe(self) -> str:
        return "triton (paged decode and prefill kernels)"

    def prepare_metadata(self, inputs: AttentionInputs) -> TritonAttentionMetadata:
        device = inputs.slot_mapping.device
        return TritonAttentionMetadata(**AttentionMetadata.common_fields(inputs),
                                       decode_block_tables=torch.from_numpy(inputs.decode_block_table).to(device),
                                       decode_context_lens=torch.from_numpy(inputs.decode_context_lens).to(device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: TritonAttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            self._decode(out, q, kv_cache, meta, scale, window, softcap)
        if meta.prefill_query_ranges:
            self._prefill(out, q, kv_cache, meta, scale, window, softcap)
        return out

    def _launch_args(self, q: torch.Tensor, kv_cache: torch.Tensor, window: int | None,
                     softcap: float | None) -> _LaunchArgs:
        """What the decode and prefill kernels share: head layout, cache strides, dtypes, features."""
        import triton.language as tl

        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
        if kv_cache.stride(-1) != 1:
            raise ValueError("the KV cache's head dimension must be contiguous")
        dtypes = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
        if q.dtype not in dtypes or kv_cache.dtype not in dtypes:
            raise ValueError(f"triton attention takes float32/float16/bfloat16, got {q.dtype} over {kv_cache.dtype}")
        # Scores in the query's dtype, as the torch backend (it widens or narrows K/V to the query's).
        compute = tl.float32 if self._kernels.INTERPRETED or q.dtype == torch.float32 else dtypes[q.dtype]
        return _LaunchArgs(
            num_kv_heads, num_heads // num_kv_heads, head_dim, _pow2(head_dim, 16), softcap or 0.0, window or 0,
            kv_cache.shape[2], (kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)),
            dict(HEAD_DIM=head_dim, HEAD_DIM_P=_pow2(head_dim, 16), HAS_WINDOW=window is not None,
                 HAS_SOFTCAP=softcap is not None, COMPUTE=compute, IEEE=compute == tl.float32))

    def _num_splits(self, rows: int, num_kv_heads: int, max_ctx: int) -> int:
        splits = min(self.max_splits, -(-max_ctx // self.split_tokens))
        if self.num_sms is not None:
            splits = min(splits, -(-2 * self.num_sms // (rows * num_kv_heads)))
        return max(1, splits)

    def _decode(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: TritonAttentionMetadata,
                scale: float, window: int | None, softcap: float | None) -> None:
        a = self._launch_args(q, kv_cache, window, softcap)
        rows, num_heads = meta.num_decodes, q.shape[1]
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        # The table's width bounds every row's context without reading the lengths back from the device.
        max_ctx = tables.shape[1] * kv_cache.shape[2]
        if window is not None:
            max_ctx = min(max_ctx, window)  # a windowed row attends at most `window` keys
        splits = self._num_splits(rows, a.num_kv_heads, max_ctx)
        # Whole key tiles per split; rounding up may leave fewer splits than asked for.
        split_tokens = -(-max_ctx // splits // DECODE_BLOCK_N) * DECODE_BLOCK_N
        splits = -(-max_ctx // split_tokens)
        splits_p = _pow2(splits)
        if splits > 1:
            part_out = torch.empty(rows, num_heads, splits_p, a.head_dim_p, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(rows, num_heads, splits_p, dtype=torch.float32, device=q.device)
        else:
            part_out = part_lse = out  # not written
        self._kernels.paged_decode_kernel[(rows, a.num_kv_heads, splits)](
            q, kv_cache[0], kv_cache[1], tables, lens, out, part_out, part_lse,
            scale, a.softcap, a.window, a.block_size, split_tokens,
            q.stride(0), q.stride(1), *a.cache_strides, tables.stride(0), out.stride(0), out.stride(1),
            GROUP=a.group, GROUP_P=_pow2(a.group, 16), BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS_P=splits_p,
            DIRECT=splits == 1, **a.constexprs)
        if splits > 1:
            self._kernels.merge_splits_kernel[(rows, num_heads)](
                part_out, part_lse, out, splits, out.stride(0), out.stride(1),
                HEAD_DIM=a.head_dim, HEAD_DIM_P=a.head_dim_p, NUM_SPLITS_P=splits_p)

    def _prefill(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: TritonAttentionMetadata,
                 scale: float, window: int | None, softcap: float | None) -> None:
        a = self._launch_args(q, kv_cache, window, softcap)
        group_p = _pow2(a.group)
        block_q = max(1, PREFILL_BLOCK_M // group_p)
        tables = meta.prefill_tables_for(block_q)
        self._kernels.paged_prefill_kernel[(tables.tile_requests.numel(), a.num_kv_heads)](
            q, kv_cache[0], kv_cache[1], tables.block_table, tables.query_starts, tables.context_lens,
            tables.tile_requests, tables.tile_offsets, out,
            scale, a.softcap, a.window, a.block_size,
            q.stride(0), q.stride(1), *a.cache_strides, tables.block_table.stride(0), out.stride(0), out.stride(1),
            GROUP=a.group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_N=PREFILL_BLOCK_N, **a.constexprs)


def make_triton_backend(device: torch.device) -> TritonAttentionBackend:
    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"the triton attention backend is unavailable: {reason}")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    return TritonAttentionBackend(num_sms=num_sms)
