"""Scheduled rows for attention tests, prepared the way the runner prepares a step: through its
persistent input batch (one new request per row, then the row's chunk scheduled)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from tokenmill.runner.input_batch import InputBatch, ModelInputs
from tokenmill.sampling_params import SamplingParams


@dataclass
class Row:
    start_position: int  # tokens already cached
    num_new_tokens: int  # this step's chunk, drafts included
    block_ids: list[int]
    spec_token_ids: list[int] = field(default_factory=list)


def prepare_rows(rows: list[Row], block_size: int, device: torch.device, backend) -> tuple[ModelInputs, object]:
    """The step's inputs, and `backend`'s metadata for them (its prepare_metadata)."""
    max_len = max(r.start_position + r.num_new_tokens for r in rows)
    batch = InputBatch(max_model_len=max(max_len, block_size), block_size=block_size)
    news, scheduled = [], []
    for i, row in enumerate(rows):
        known = row.num_new_tokens - len(row.spec_token_ids)
        tokens = [1 + p % 97 for p in range(row.start_position + known)]
        news.append(NewRequestData(f"r{i}", tokens, SamplingParams(max_tokens=1)))
        scheduled.append(ScheduledRequest(f"r{i}", row.start_position, row.num_new_tokens,
                                          tokens[row.start_position:], row.block_ids,
                                          spec_token_ids=row.spec_token_ids))
    states = batch.update(SchedulerOutput(new_requests=news, scheduled=scheduled))
    inputs = batch.prepare(scheduled, states, device, backend.paged_decode)
    return inputs, backend.prepare_metadata(inputs.attention[0])
