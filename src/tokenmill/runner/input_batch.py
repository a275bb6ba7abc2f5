"""The runner's own per-request state, kept up to date by the scheduler's per-step deltas, and the
flat tensors built from it for each step.

The runner never sees the core's `Request` objects: a request arrives once as `NewRequestData`
(prompt, tokens generated so far, sampling parameters) and from then on only as deltas (the
chunk's token ids, block ids appended since the last step). Tokens are kept by position, so a
speculative verify that rejects drafts is corrected by the next chunk, which starts where the
kept tokens end and overwrites the rest.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from tokenmill.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from tokenmill.model.layers.attention import AttentionMetadata, DecodeBucket
from tokenmill.sampling_params import SamplingParams

# A decode bucket may pad its members up to this factor of their real total context.
MAX_PADDING_FACTOR = 1.25
MIN_BUCKET_SIZE = 8


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # Flat index of each scheduled request's last token, in the order of the rows given.
    last_token_index: list[int]
    # KV cache groups 1, 2, ... (core.kv_cache_groups): the same batch through their own block tables.
    more_metas: list[AttentionMetadata] = field(default_factory=list)


@dataclass(slots=True)
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    # Every token by position (prompt, generated, and the drafts of the last verify).
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    # Its row of the batch's persistent block table (None: no table kept).
    row: Optional[int] = None
    # Block tables of KV cache groups 1, 2, ... (group 0's is block_ids).
    more_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class OutputTokens(Sequence):
    """The generated tokens of a request as a view (no copy per step): what the sampler's
    penalties, min_tokens and per-request seeds read."""

    __slots__ = ("_tokens", "_start", "_end")

    def __init__(self, tokens: list[int], start: int, end: int) -> None:
        self._tokens, self._start, self._end = tokens, start, end

    def __len__(self) -> int:
        return max(0, self._end - self._start)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._tokens[self._start:self._end][index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._tokens[self._start + index]

    def __iter__(self):
        tokens = self._tokens
        for i in range(self._start, self._end):
            yield tokens[i]


@dataclass(slots=True)
class StepRow:
    """One scheduled request as build_model_inputs reads it."""

    start_position: int
    num_new_tokens: int
    token_ids: list[int]  # the known tokens, then the drafts
    block_ids: list[int]  # the request's whole block table (the runner's own list)
    spec_token_ids: list[int]
    row: Optional[int] = None  # its row of the persistent block table, when there is one
    more_block_ids: list[list[int]] = field(default_factory=list)  # KV cache groups 1, 2, ...

    def group_block_ids(self, group: int) -> list[int]:
        return self.block_ids if group == 0 else self.more_block_ids[group - 1]


class InputBatch:
    """The runner's requests, updated from each step's SchedulerOutput.

    Besides each request's lists, the batch keeps one persistent int32 block table, a row per request
    (rows reused as requests come and go), written only where a step's delta adds block ids; a decode
    step's [decodes, max_blocks] table is then one gather of its rows instead of lists built anew.
    """

    def __init__(self, max_blocks_per_request: Optional[int] = None, num_groups: int = 1) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        self.max_blocks = max_blocks_per_request
        self.num_groups = num_groups
        self.block_table: Optional[np.ndarray] = None
        # KV cache groups 1, 2, ...: their tables, rows as in block_table.
        self.more_block_tables: list[np.ndarray] = []
        if max_blocks_per_request is not None:
            self.block_table = np.zeros((16, max_blocks_per_request), dtype=np.int32)
            self.more_block_tables = [np.zeros_like(self.block_table) for _ in range(num_groups - 1)]
        self._free_rows: list[int] = list(range(15, -1, -1))

    def _drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None and state.row is not None:
            self._free_rows.append(state.row)

    def _assign_row(self, state: CachedRequestState) -> None:
        if self.block_table is None:
            return
        if not self._free_rows:
            old = self.block_table.shape[0]
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self.more_block_tables = [np.concatenate([t, np.zeros_like(t)]) for t in self.more_block_tables]
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        state.row = self._free_rows.pop()

    def update(self, output: SchedulerOutput) -> list[CachedRequestState]:
        """Apply the step's deltas; returns the scheduled requests' states in `output.scheduled` order."""
        for request_id in output.finished_ids:
            self._drop(request_id)
        for request_id in output.preempted_ids:
            self._drop(request_id)
        for new in output.new_requests:
            self._drop(new.request_id)
            state = self.requests[new.request_id] = _new_state(new)
            state.more_block_ids = [[] for _ in range(self.num_groups - 1)]
            self._assign_row(state)
        states = []
        table = self.block_table
        for item in output.scheduled:
            state = self.requests[item.request_id]
            if item.new_block_ids:
                start = len(state.block_ids)
                end = start + len(item.new_block_ids)
                if table is not None:
                    table[state.row, start:end] = item.new_block_ids
                    for more_table, ids in zip(self.more_block_tables, item.more_group_block_ids):
                        more_table[state.row, start:end] = ids
                state.block_ids.extend(item.new_block_ids)
                for blocks, ids in zip(state.more_block_ids, item.more_group_block_ids):
                    blocks.extend(ids)
            tokens = state.token_ids
            del tokens[item.start_position:]
            tokens.extend(item.token_ids)
            tokens.extend(item.spec_token_ids)
            states.append(state)
        return states


def _new_state(new: NewRequestData) -> CachedRequestState:
    return CachedRequestState(new.request_id, new.prompt_token_ids, new.sampling_params, new.eos_token_id,
                              token_ids=[*new.prompt_token_ids, *new.output_token_ids])


def step_rows(scheduled: Sequence[ScheduledRequest], states: Sequence[CachedRequestState]) -> list[StepRow]:
    rows = []
    for item, state in zip(scheduled, states):
        end = item.start_position + item.num_new_tokens
        rows.append(StepRow(item.start_position, item.num_new_tokens, state.token_ids[item.start_position:end],
                            state.block_ids, item.spec_token_ids, state.row, state.more_block_ids))
    return rows


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


def build_model_inputs(scheduled: Sequence[StepRow], block_size: int, device: torch.device,
                       decode_buckets: bool = True, block_table: Optional[np.ndarray] = None,
                       more_block_tables: Sequence[np.ndarray] = ()) -> ModelInputs:
    """Flat token tensors + attention metadata; decodes as padded buckets or as block tables (gathered
    from the batch's persistent `block_table` when given and every row has its place there). Rows with
    `more_block_ids` (several KV cache groups) get one metadata per group, each through its own table."""
    indexed = list(enumerate(scheduled))
    # With block tables (paged-kernel backends), a speculative verify is attended as one decode row
    # per position: the same blocks, each row's context one token longer. Its rows stay together, in
    # order, so the runner finds them right before the request's last token.
    def as_decode(item: StepRow) -> bool:
        return item.num_new_tokens == 1 or (not decode_buckets and bool(item.spec_token_ids))

    decodes = sorted((p for p in indexed if as_decode(p[1])), key=lambda p: p[1].start_position)
    prefills = [p for p in indexed if not as_decode(p[1])]

    input_ids: list[int] = []
    positions: list[int] = []
    last_index = [0] * len(indexed)
    for original, item in decodes + prefills:
        start, count = item.start_position, item.num_new_tokens
        input_ids.extend(item.token_ids)
        positions.extend(range(start, start + count))
        last_index[original] = len(input_ids) - 1

    num_groups = 1 + (len(scheduled[0].more_block_ids) if scheduled else 0)
    tables = [block_table, *(more_block_tables or [None] * (num_groups - 1))]
    metas = [_attention_metadata(decodes, prefills, group, block_size, device, decode_buckets, tables[group])
             for group in range(num_groups)]
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=metas[0],
        last_token_index=last_index,
        more_metas=metas[1:],
    )


def _attention_metadata(decodes: list[tuple[int, StepRow]], prefills: list[tuple[int, StepRow]], group: int,
                        block_size: int, device: torch.device, decode_buckets: bool,
                        block_table: Optional[np.ndarray]) -> AttentionMetadata:
    """The step's slots, decode tables or buckets and prefill blocks through one KV cache group's tables."""
    slots: list[int] = []
    for _, item in decodes + prefills:
        start, count, blocks = item.start_position, item.num_new_tokens, item.group_block_ids(group)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, start + count))

    # One decode row per position: (its request, its context length incl. itself).
    rows = [(pair, pair[1].start_position + 1 + i) for pair in decodes for i in range(pair[1].num_new_tokens)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                             num_decodes=len(rows))
    lengths = [length for _, length in rows]
    if decode_buckets:
        for lo, hi in _bucket_decodes(lengths):
            meta.decode_buckets.append(_decode_bucket(decodes[lo:hi], lengths[lo:hi], lo, block_size, device, group))
    elif decodes:
        meta.decode_block_tables, meta.decode_context_lens = _block_tables([pair for pair, _ in rows], lengths,
                                                                           block_size, device, block_table, group)

    offset = len(rows)  # prefill chunks start after every decode row
    for _, item in prefills:
        ctx_len = item.start_position + item.num_new_tokens
        meta.prefill_query_ranges.append((offset, offset + item.num_new_tokens))
        meta.prefill_context_lens.append(ctx_len)
        meta.prefill_block_ids.append(torch.tensor(item.group_block_ids(group)[:_num_blocks(ctx_len, block_size)],
                                                   dtype=torch.long, device=device))
        offset += item.num_new_tokens
    return meta


def _block_tables(members: list[tuple[int, StepRow]], lengths: list[int], block_size: int, device: torch.device,
                  block_table: Optional[np.ndarray] = None, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[len(members), max_blocks] int32 block ids and [len(members)] int32 lengths. Entries past a
    row's own blocks are never read (its length bounds the kernel): 0 in a built table, whatever an
    earlier request left in a gathered one."""
    max_blocks = _num_blocks(max(lengths), block_size)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if block_table is not None and all(item.row is not None for _, item in members):
        gathered = block_table[[item.row for _, item in members], :max_blocks]
        return torch.from_numpy(gathered).to(device), context_lens
    rows = []
    for (_, item), length in zip(members, lengths):
        row = item.group_block_ids(group)[:_num_blocks(length, block_size)]
        rows.append(row + [0] * (max_blocks - len(row)))
    return torch.tensor(rows, dtype=torch.int32, device=device), context_lens


def _decode_bucket(members: list[tuple[int, StepRow]], lengths: list[int], start: int, block_size: int,
                   device: torch.device, group: int = 0) -> DecodeBucket:
    max_blocks = _num_blocks(max(lengths), block_size)
    table: list[int] = []
    for _, item in members:
        row = item.group_block_ids(group)[:_num_blocks(item.start_position + 1, block_size)]
        table.extend(row)
        table.extend([0] * (max_blocks - len(row)))  # padding: block 0, hidden by the mask
    key_pos = torch.arange(max_blocks * block_size)
    mask = key_pos.unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return DecodeBucket(start=start, end=start + len(members),
                        block_ids=torch.tensor(table, dtype=torch.long, device=device),
                        max_blocks=max_blocks, mask=mask.view(len(members), 1, 1, -1).to(device))
