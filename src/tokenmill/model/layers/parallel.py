"""Tensor parallelism at the level of the weights: which slice of each checkpoint tensor a rank holds.

A rank's model is the ordinary decoder built from a smaller `DecoderSpec` (its share of the heads,
of the MLP's intermediate features and of the vocabulary), so every layer class, packed or
block-int8, is constructed as usual from already-sliced weights:

    column-parallel (rows split)     q/k/v (by head, so each rank holds whole KV heads and the query
                                     heads that share them), gate/up; a checkpoint's fused qkv_proj and
                                     gate_up_proj (Phi-3) split part by part, so a rank's fused rows are
                                     its q, its k and its v (its gate, its up)
    row-parallel (columns split)     o_proj, down_proj: each rank's output is a partial sum, all-reduced;
                                     a bias is added once (rank 0 holds it, the others zeros)
    experts (intermediate split)     every rank holds every expert (and the replicated router), with
                                     1/N of each expert's features: gate/up rows, down_proj columns;
                                     the routed sum is a partial sum, all-reduced like down_proj's
    vocab-parallel (rows split)      embed_tokens (lookups outside the rank's range are zeros,
                                     all-reduced), lm_head (each rank's logits, gathered)
    replicated                       norms, q/k head norms, rotary tables

    one decoder layer on rank r of N:
        x ─► qkv (heads r·H/N ..) ─► attention (KV heads r·K/N ..) ─► o_proj (those inputs) ─► all-reduce ─►
          ─► gate/up (features r·I/N ..) ─► act ─► down_proj (those inputs) ─► all-reduce ─►

The vocabulary is padded to a multiple of the rank count with zero rows; the gathered logits are
cut back to the model's vocabulary.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import TensorParallelGroup
from tokenmill.model.layers.decoder import DecoderSpec
from tokenmill.model.layers.linear import QUANT_BLOCK, Int8Blocks

logger = logging.getLogger("tokenmill")

_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW_WEIGHT = re.compile(r"\.(o_proj|down_proj)\.weight$")
_ROW_BIAS = re.compile(r"\.(o_proj|down_proj)\.bias$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")
_FUSED_QKV = re.compile(r"\.qkv_proj\.(weight|bias)$")
_FUSED_GATE_UP = re.compile(r"\.gate_up_proj\.weight$")
# Experts stacked in one [E, rows, cols] tensor: transformers 5's layout (experts.gate_up_proj) and a
# GGUF's *_exps (experts.gate_proj.weight). Per-expert names (experts.7.gate_proj.weight) are plain
# column/row-parallel matrices.
_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?$")


def check_divisible(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int,
                    moe_intermediate_size: int = 0) -> None:
    """ValueError naming the first dimension that `size` ranks cannot split evenly."""
    for name, value in (("num_key_value_heads", num_kv_heads), ("num_attention_heads", num_heads),
                        ("intermediate_size", intermediate_size), ("moe_intermediate_size", moe_intermediate_size)):
        if value % size:
            raise ValueError(f"{name} ({value}) is not divisible by --tensor-parallel-size {size}")


def local_vocab_size(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


def shard_spec(spec: DecoderSpec, size: int) -> DecoderSpec:
    """One rank's share of a decoder: heads, KV heads, MLP features and the (padded) vocabulary."""
    check_divisible(spec.num_heads, spec.num_kv_heads, spec.intermediate_size, size, spec.moe_intermediate_size)
    return dataclasses.replace(spec, num_heads=spec.num_heads // size, num_kv_heads=spec.num_kv_heads // size,
                               intermediate_size=spec.intermediate_size // size,
                               moe_intermediate_size=spec.moe_intermediate_size // size,
                               vocab_size=local_vocab_size(spec.vocab_size, size))


def fused_qkv_rows(spec: DecoderSpec, size: int) -> tuple[int, int, int]:
    """The whole model's q, k and v rows of a fused qkv_proj, from one rank's (sharded) spec."""
    kv = spec.num_kv_heads * size * spec.head_dim
    return spec.num_heads * size * spec.head_dim, kv, kv


class VocabParallelEmbedding(nn.Embedding):
    """The rank's rows [start, start + num_embeddings) of the embedding; other ids look up zeros, and
    the all-reduce adds the one rank's row to zeros (exact)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.tp = tp
        self.start = tp.rank * num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


# ---- slicing checkpoint tensors ------------------------------------------------------------------
def _vocab_rows(tensor: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """Rows [r * n, (r + 1) * n) of a [vocab, ...] tensor, zero-padded past the vocabulary."""
    rows = local_vocab_size(tensor.shape[0], tp.size)
    start = tp.rank * rows
    part = tensor[start:start + rows]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
    return part.contiguous()


def _fused_parts(tensor: torch.Tensor, sizes: list[int], dim: int, tp: TensorParallelGroup) -> torch.Tensor:
    """The rank's share of each part of a fused tensor along `dim`, joined in the parts' order."""
    parts = tensor.split(sizes, dim=dim)
    return torch.cat([part.chunk(tp.size, dim=dim)[tp.rank] for part in parts], dim=dim).contiguous()


def _fused_row_parts(name: str, rows: int, qkv_rows: Optional[tuple[int, int, int]]) -> Optional[list[int]]:
    """The rows of each part of a checkpoint matrix that fuses q/k/v or gate/up; None for any other."""
    if _FUSED_QKV.search(name):
        if qkv_rows is None:
            raise ValueError(f"{name}: a fused qkv_proj needs its q/k/v sizes to be split")
        return list(qkv_rows)
    if _FUSED_GATE_UP.search(name):
        return [rows // 2] * 2
    return None


def shard_tensor(name: str, tensor: torch.Tensor, tp: TensorParallelGroup,
                 qkv_rows: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """This rank's slice of the checkpoint tensor `name` (HF names). qkv_rows: the q, k and v rows of
    a fused qkv_proj (`fused_qkv_rows`), needed where the checkpoint fuses them."""
    experts = _STACKED_EXPERTS.search(name)
    if experts is not None and tensor.dim() == 3:
        part = experts.group(1)
        if part == "down_proj":  # [E, hidden, features]
            return tensor.chunk(tp.size, dim=2)[tp.rank].contiguous()
        if part == "gate_up_proj":  # [E, 2 * features, hidden], gate rows first
            return _fused_parts(tensor, [tensor.shape[1] // 2] * 2, 1, tp)
        return tensor.chunk(tp.size, dim=1)[tp.rank].contiguous()
    fused = _fused_row_parts(name, tensor.shape[0], qkv_rows)
    if fused is not None:
        return _fused_parts(tensor, fused, 0, tp)
    if _COLUMN.search(name):
        return tensor.chunk(tp.size, dim=0)[tp.rank].contiguous()
    if _ROW_WEIGHT.search(name):
        return tensor.chunk(tp.size, dim=1)[tp.rank].contiguous()
    if _ROW_BIAS.search(name):
        # The partial sums are all-reduced: the bias must be added by one rank only.
        return tensor if tp.is_driver else torch.zeros_like(tensor)
    if _VOCAB.search(name):
        return _vocab_rows(tensor, tp)
    return tensor


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], tp: TensorParallelGroup,
                  qkv_rows: Optional[tuple[int, int, int]] = None) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name, shard_tensor(name, tensor, tp, qkv_rows)


def int8_rows(blocks: Int8Blocks, start: int, end: int) -> Int8Blocks:
    """Output features [start, end) (rows past the matrix come back as zeros: a padded vocabulary)."""
    def take(t: torch.Tensor) -> torch.Tensor:
        part = t[start:end]
        if part.shape[0] < end - start:
            part = torch.cat([part, part.new_zeros(end - start - part.shape[0], *part.shape[1:])])
        return part.contiguous()

    return blocks.map_rows(take)


def int8_columns(blocks: Int8Blocks, start: int, end: int) -> Int8Blocks:
    """Input features [start, end), which must fall on 32-value block boundaries."""
    if start % QUANT_BLOCK or end % QUANT_BLOCK:
        raise ValueError(f"block-int8 columns [{start}, {end}) do not fall on {QUANT_BLOCK}-value blocks")
    first, last = start // QUANT_BLOCK, end // QUANT_BLOCK
    return Int8Blocks(blocks.q[:, start:end].contiguous(), blocks.scales[:, first:last].contiguous(),
                      None if blocks.mins is None else blocks.mins[:, first:last].contiguous())


def shard_int8_blocks(int8_blocks: dict[str, Int8Blocks], tp: TensorParallelGroup,
                      qkv_rows: Optional[tuple[int, int, int]] = None) -> None:
    """Slices a GGUF's kept block-int8 matrices in place, as `shard_tensor` slices the dense ones. A
    row-parallel matrix whose share of the inputs does not fall on 32-value blocks is dropped (its
    layer runs on the dense weights), with a log line."""
    for name in list(int8_blocks):
        blocks = int8_blocks[name]
        out_features, in_features = blocks.q.shape
        fused = _fused_row_parts(name, out_features, qkv_rows)
        if fused is not None:  # the same rows of q, scales and mins as of the dense matrix
            int8_blocks[name] = blocks.map_rows(lambda t: _fused_parts(t, fused, 0, tp))
        elif _COLUMN.search(name):
            rows = out_features // tp.size
            int8_blocks[name] = int8_rows(blocks, tp.rank * rows, (tp.rank + 1) * rows)
        elif _ROW_WEIGHT.search(name):
            cols = in_features // tp.size
            if cols % QUANT_BLOCK:
                logger.info("%s: %d input features per rank do not fall on %d-value blocks; the layer runs "
                            "dense under tensor parallelism", name, cols, QUANT_BLOCK)
                del int8_blocks[name]
                continue
            int8_blocks[name] = int8_columns(blocks, tp.rank * cols, (tp.rank + 1) * cols)
        elif _VOCAB.search(name):
            rows = local_vocab_size(out_features, tp.size)
            int8_blocks[name] = int8_rows(blocks, tp.rank * rows, (tp.rank + 1) * rows)


def gather_logits(logits: torch.Tensor, tp: Optional[TensorParallelGroup], vocab_size: int) -> torch.Tensor:
    """Every rank's slice of the vocabulary's logits, joined and cut back to the model's vocabulary."""
    if tp is None:
        return logits
    return tp.all_gather_last_dim(logits)[..., :vocab_size]
