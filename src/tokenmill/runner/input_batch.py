"""Turns a SchedulerOutput into the flat tensors the model consumes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.sched_output import ScheduledRequest, SchedulerOutput
from tokenmill.model.layers.attention import AttentionMetadata, DecodeBucket

# A decode bucket may pad its members up to this factor of their real total context.
MAX_PADDING_FACTOR = 1.25
MIN_BUCKET_SIZE = 8


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # Flat index of each scheduled request's last token, in SchedulerOutput.scheduled order.
    last_token_index: list[int]


def _num_blocks(ctx_len: int, block_size: int) -> int:
    return -(-ctx_len // block_size)


def _bucket_decodes(lengths: list[int]) -> list[tuple[int, int]]:
    """Split ascending context lengths into [start, end) runs whose padding stays bounded."""
    buckets, start, total = [], 0, 0
    for i, length in enumerate(lengths):
        count = i - start + 1
        if count > MIN_BUCKET_SIZE and count * length > MAX_PADDING_FACTOR * (total + length):
            buckets.append((start, i))
            start, total = i, 0
        total += length
    if lengths:
        buckets.append((start, len(lengths)))
    return buckets


def build_model_inputs(output: SchedulerOutput, block_size: int, device: torch.device,
                       decode_buckets: bool = True) -> ModelInputs:
    """Flat token tensors + attention metadata; decodes as padded buckets or as block tables."""
    indexed = list(enumerate(output.scheduled))
    # With block tables (paged-kernel backends), a speculative verify is attended as one decode row
    # per position: the same blocks, each row's context one token longer. Its rows stay together, in
    # order, so the runner finds them right before the request's last token.
    def as_decode(item: ScheduledRequest) -> bool:
        return item.num_new_tokens == 1 or (not decode_buckets and bool(item.spec_token_ids))

    decodes = sorted((p for p in indexed if as_decode(p[1])), key=lambda p: p[1].start_position)
    prefills = [p for p in indexed if not as_decode(p[1])]

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last_index = [0] * len(indexed)
    for original, item in decodes + prefills:
        start, count, blocks = item.start_position, item.num_new_tokens, item.block_ids
        input_ids.extend(item.token_ids)
        positions.extend(range(start, start + count))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, start + count))
        last_index[original] = len(input_ids) - 1

    # One decode row per position: (its request, its context length incl. itself).
    rows = [(pair, pair[1].start_position + 1 + i) for pair in decodes for i in range(pair[1].num_new_tokens)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                             num_decodes=len(rows))
    lengths = [length for _, length in rows]
    if decode_buckets:
        for lo, hi in _bucket_decodes(lengths):
            meta.decode_buckets.append(_decode_bucket(decodes[lo:hi], lengths[lo:hi], lo, block_size, device))
    elif decodes:
        meta.decode_block_tables, meta.decode_context_lens = _block_tables([pair for pair, _ in rows], lengths,
                                                                           block_size, device)

    offset = len(rows)  # prefill chunks start after every decode row
    for _, item in prefills:
        ctx_len = item.start_position + item.num_new_tokens
        meta.prefill_query_ranges.append((offset, offset + item.num_new_tokens))
        meta.prefill_context_lens.append(ctx_len)
        meta.prefill_block_ids.append(torch.tensor(item.block_ids[:_num_blocks(ctx_len, block_size)],
                                                   dtype=torch.long, device=device))
        offset += item.num_new_tokens

    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        last_token_index=last_index,
    )


def _block_tables(members: list[tuple[int, ScheduledRequest]], lengths: list[int], block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[len(members), max_blocks] int32 block ids (padded with 0) and [len(members)] int32 lengths."""
    max_blocks = _num_blocks(max(lengths), block_size)
    rows = []
    for (_, item), length in zip(members, lengths):
        row = item.block_ids[:_num_blocks(length, block_size)]
        rows.append(row + [0] * (max_blocks - len(row)))
    return (torch.tensor(rows, dtype=torch.int32, device=device),
            torch.tensor(lengths, dtype=torch.int32, device=device))


def _decode_bucket(members: list[tuple[int, ScheduledRequest]], lengths: list[int], start: int, block_size: int,
                   device: torch.device) -> DecodeBucket:
    max_blocks = _num_blocks(max(lengths), block_size)
    table: list[int] = []
    for _, item in members:
        row = item.block_ids[:_num_blocks(item.start_position + 1, block_size)]
        table.extend(row)
        table.extend([0] * (max_blocks - len(row)))  # padding: block 0, hidden by the mask
    key_pos = torch.arange(max_blocks * block_size)
    mask = key_pos.unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return DecodeBucket(start=start, end=start + len(members),
                        block_ids=torch.tensor(table, dtype=torch.long, device=device),
                        max_blocks=max_blocks, mask=mask.view(len(members), 1, 1, -1).to(device))
