"""Turns a SchedulerOutput into the flat tensors the model consumes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.model.layers.attention import AttentionMetadata


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # Flat index of each scheduled request's last token (its logits are sampled when it samples).
    last_token_index: list[int]


def build_model_inputs(output: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last_index: list[int] = []
    num_decodes = 0
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    ranges: list[tuple[int, int]] = []
    ctx_lens: list[int] = []
    prefill_blocks: list[torch.Tensor] = []

    for item in output.scheduled:
        start, count, blocks = item.start_position, item.num_new_tokens, item.block_ids
        flat_start = len(input_ids)
        input_ids.extend(item.token_ids)
        positions.extend(range(start, start + count))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, start + count))
        last_index.append(len(input_ids) - 1)
        ctx_len = start + count
        if count == 1 and not ranges:
            num_decodes += 1
            decode_tables.append(blocks[: -(-ctx_len // block_size)])
            decode_lens.append(ctx_len)
        else:
            ranges.append((flat_start, flat_start + count))
            ctx_lens.append(ctx_len)
            prefill_blocks.append(torch.tensor(blocks[: -(-ctx_len // block_size)], dtype=torch.long, device=device))

    decode_block_tables = torch.zeros((0, 1), dtype=torch.long)
    decode_seq_lens = torch.zeros(0, dtype=torch.long)
    decode_mask = None
    if num_decodes:
        max_blocks = max(len(t) for t in decode_tables)
        # Padding entries point at block 0; the mask hides them.
        decode_block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in decode_tables], dtype=torch.long)
        decode_seq_lens = torch.tensor(decode_lens, dtype=torch.long)
        key_pos = torch.arange(max_blocks * block_size)
        decode_mask = (key_pos.unsqueeze(0) < decode_seq_lens.unsqueeze(1)).view(num_decodes, 1, 1, -1).to(device)
        decode_block_tables = decode_block_tables.to(device)
        decode_seq_lens = decode_seq_lens.to(device)

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decodes=num_decodes,
        decode_block_tables=decode_block_tables,
        decode_seq_lens=decode_seq_lens,
        decode_mask=decode_mask,
        prefill_query_ranges=ranges,
        prefill_context_lens=ctx_lens,
        prefill_block_ids=prefill_blocks,
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        last_token_index=last_index,
    )
