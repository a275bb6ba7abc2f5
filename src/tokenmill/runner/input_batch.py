"""The runner's persistent input batch: per-request state kept in arrays that the scheduler's per-step
deltas update in place, and the flat tensors of each step gathered from them.

The runner never sees the core's `Request` objects: a request arrives once as `NewRequestData`
(prompt, tokens generated so far, sampling parameters) and from then on only as deltas (the
chunk's token ids, block ids appended since the last step). Each request owns a row of the batch's
arrays, reused once it leaves:

    token_ids      [rows, max_model_len] int32   every token by position (prompt, generated, drafts)
    block_tables   [groups][rows, max_blocks] int32   one table per KV cache group
    sampling       SamplingArrays [rows]         temperature, top-k, top-p, min-p, written when a request joins

A step's input ids, positions and slot mapping are then a few vectorized gathers over the scheduled
rows, not lists built anew. Tokens are kept by position, so a speculative verify that rejects drafts
is corrected by the next chunk, which starts where the kept tokens end and overwrites the rest.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tokenmill.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from tokenmill.model.layers.attention import AttentionInputs
from tokenmill.sample.sampler import SamplingArrays, SamplingRequestState
from tokenmill.sampling_params import SamplingParams

INITIAL_ROWS = 16


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    # The step's attention layout through each KV cache group's block tables (core.kv_cache_groups); the
    # attention backend turns each into its metadata.
    attention: list[AttentionInputs]
    # Flat index of each scheduled request's last token, in the order of the rows given.
    last_token_index: list[int]
    token_rows: np.ndarray  # [T] the batch row each token belongs to


@dataclass(slots=True)
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    row: int  # its row of the batch's arrays
    # Entries in the request's block table (every KV cache group's table holds as many: one per block of tokens).
    num_blocks: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class InputBatch:
    """The runner's requests, updated from each step's SchedulerOutput (see the module docstring)."""

    def __init__(self, max_model_len: int, block_size: int, num_groups: int = 1,
                 max_num_reqs: int = INITIAL_ROWS) -> None:
        self.block_size = block_size
        self.requests: dict[str, CachedRequestState] = {}
        rows = max(1, max_num_reqs)
        # np.zeros maps untouched pages lazily: a row costs memory only as far as its tokens reach.
        self.token_ids = np.zeros((rows, max_model_len), dtype=np.int32)
        self.block_tables = [np.zeros((rows, -(-max_model_len // block_size)), dtype=np.int32)
                             for _ in range(num_groups)]
        self.sampling = SamplingArrays.empty(rows)
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))

    # ---- deltas ----------------------------------------------------------------------------
    @property
    def block_table(self) -> np.ndarray:
        """KV cache group 0's table."""
        return self.block_tables[0]

    def update(self, output: SchedulerOutput) -> list[CachedRequestState]:
        """Apply the step's deltas; returns the scheduled requests' states in `output.scheduled` order."""
        for request_id in output.finished_ids:
            self._drop(request_id)
        for request_id in output.preempted_ids:
            self._drop(request_id)
        for new in output.new_requests:
            self._add(new)
        states = []
        for item in output.scheduled:
            state = self.requests[item.request_id]
            if item.new_block_ids:
                start, count = state.num_blocks, len(item.new_block_ids)
                self.block_tables[0][state.row, start:start + count] = item.new_block_ids
                for table, ids in zip(self.block_tables[1:], item.more_group_block_ids):
                    table[state.row, start:start + count] = ids
                state.num_blocks += count
            self._write_tokens(state.row, item.start_position, item.token_ids, item.spec_token_ids)
            states.append(state)
        return states

    def _add(self, new: NewRequestData) -> None:
        self._drop(new.request_id)
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self.requests[new.request_id] = CachedRequestState(new.request_id, new.prompt_token_ids, new.sampling_params,
                                                           new.eos_token_id, row)
        self._write_tokens(row, 0, new.prompt_token_ids, new.output_token_ids)
        self.sampling.write(row, new.sampling_params)

    def _drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def _write_tokens(self, row: int, start: int, tokens: Sequence[int], more: Sequence[int] = ()) -> None:
        end = start + len(tokens) + len(more)
        if end > self.token_ids.shape[1]:
            self._grow_columns(end)
        self.token_ids[row, start:start + len(tokens)] = tokens
        if more:
            self.token_ids[row, start + len(tokens):end] = more

    def _grow_rows(self) -> None:
        old = self.token_ids.shape[0]

        def doubled(array: np.ndarray) -> np.ndarray:
            grown = np.zeros((2 * old, *array.shape[1:]), dtype=array.dtype)
            grown[:old] = array
            return grown

        self.token_ids = doubled(self.token_ids)
        self.block_tables = [doubled(table) for table in self.block_tables]
        self.sampling = self.sampling.grown(2 * old)
        self._free_rows = list(range(2 * old - 1, old - 1, -1))

    def _grow_columns(self, width: int) -> None:
        """A row longer than max_model_len (drafts past the end): never in serving, kept safe anyway."""
        grown = np.zeros((self.token_ids.shape[0], max(width, 2 * self.token_ids.shape[1])), dtype=np.int32)
        grown[:, :self.token_ids.shape[1]] = self.token_ids
        self.token_ids = grown

    # ---- reads -----------------------------------------------------------------------------
    def output_tokens(self, state: CachedRequestState, known_end: int) -> np.ndarray:
        """The request's generated tokens before `known_end` (a view: no copy per step)."""
        return self.token_ids[state.row, state.num_prompt_tokens:known_end]

    def known_tokens(self, state: CachedRequestState, known_end: int) -> np.ndarray:
        """Prompt and generated tokens before `known_end` (a view)."""
        return self.token_ids[state.row, :known_end]

    def sampling_state(self, state: CachedRequestState, known_end: int,
                       grammar_row: Optional[int] = None) -> SamplingRequestState:
        """What the sampler needs of a request drawing the token at position known_end (its tokens before it
        as views of the batch's row; grammar_row: its row of the step's grammar bitmask)."""
        return SamplingRequestState(params=state.sampling_params, prompt_token_ids=state.prompt_token_ids,
                                    output_token_ids=self.output_tokens(state, known_end),
                                    eos_token_id=state.eos_token_id, grammar_row=grammar_row,
                                    known_token_ids=self.known_tokens(state, known_end))

    def sampling_arrays(self, rows: Sequence[int]) -> SamplingArrays:
        """The sampling parameters of these rows (in this order), gathered from the persistent arrays."""
        return self.sampling.select(rows)

    # ---- the step's tensors ----------------------------------------------------------------
    def prepare(self, scheduled: Sequence[ScheduledRequest], states: Sequence[CachedRequestState],
                device: torch.device, paged_decode: bool = False) -> ModelInputs:
        """Flat input ids, positions and attention layout (one per KV cache group) for the step.

        Decodes come first, ordered by context length, then prefill chunks. With paged_decode (a backend
        attending decodes through block tables) a speculative verify is attended as one decode row per
        position: the same blocks, each row's context one token longer; its rows stay together, in order,
        so the runner finds them right before the request's last token.
        """
        n = len(scheduled)
        starts = np.fromiter((item.start_position for item in scheduled), dtype=np.int64, count=n)
        counts = np.fromiter((item.num_new_tokens for item in scheduled), dtype=np.int64, count=n)
        rows = np.fromiter((state.row for state in states), dtype=np.int64, count=n)
        is_decode = counts == 1
        if paged_decode:
            is_decode |= np.fromiter((bool(item.spec_token_ids) for item in scheduled), dtype=bool, count=n)
        decode_order = np.flatnonzero(is_decode)
        decode_order = decode_order[np.argsort(starts[decode_order], kind="stable")]
        order = np.concatenate([decode_order, np.flatnonzero(~is_decode)])

        counts, starts, rows = counts[order], starts[order], rows[order]
        ends = np.cumsum(counts)
        token_rows = np.repeat(rows, counts)
        # Each token's position: its chunk's start plus its offset in the chunk.
        positions = np.repeat(starts - (ends - counts), counts) + np.arange(int(ends[-1]) if n else 0)
        input_ids = self.token_ids[token_rows, positions]
        last_index = np.empty(n, dtype=np.int64)
        last_index[order] = ends - 1

        num_decode_items = len(decode_order)
        num_decode_tokens = int(ends[num_decode_items - 1]) if num_decode_items else 0
        step = _Step(token_rows, positions, num_decode_tokens, starts[num_decode_items:], counts[num_decode_items:],
                     rows[num_decode_items:], ends[num_decode_items:] - counts[num_decode_items:])
        return ModelInputs(
            input_ids=torch.from_numpy(input_ids.astype(np.int64)).to(device),
            positions=torch.from_numpy(positions).to(device),
            attention=[self._attention_inputs(step, table, device) for table in self.block_tables],
            last_token_index=last_index.tolist(),
            token_rows=token_rows,
        )

    def _attention_inputs(self, step: _Step, table: np.ndarray, device: torch.device) -> AttentionInputs:
        """The step's slots, decode rows' tables and prefill chunks' blocks through one KV cache group's table."""
        bs = self.block_size
        slots = table[step.token_rows, step.positions // bs].astype(np.int64) * bs + step.positions % bs
        decode_rows = step.token_rows[:step.num_decodes]
        lengths = (step.positions[:step.num_decodes] + 1).astype(np.int32)  # a decode row's context includes itself
        max_blocks = _num_blocks(int(lengths.max()), bs) if step.num_decodes else 0
        inputs = AttentionInputs(slot_mapping=torch.from_numpy(slots).to(device), block_size=bs,
                                 num_decodes=step.num_decodes, decode_block_table=table[decode_rows, :max_blocks],
                                 decode_context_lens=lengths)
        for start, count, row, offset in zip(step.prefill_starts.tolist(), step.prefill_counts.tolist(),
                                             step.prefill_rows.tolist(), step.prefill_offsets.tolist()):
            ctx_len = start + count
            inputs.prefill_query_ranges.append((offset, offset + count))
            inputs.prefill_context_lens.append(ctx_len)
            inputs.prefill_block_ids.append(table[row, :_num_blocks(ctx_len, bs)].astype(np.int64))
        return inputs


@dataclass(slots=True)
class _Step:
    """One step's flat layout, shared by every KV cache group's metadata."""

    token_rows: np.ndarray  # [T] the batch row of each token
    positions: np.ndarray  # [T]
    num_decodes: int  # the first num_decodes tokens are decode rows
    prefill_starts: np.ndarray
    prefill_counts: np.ndarray
    prefill_rows: np.ndarray
    prefill_offsets: np.ndarray  # where each prefill chunk starts in the flat batch


def _num_blocks(ctx_len: int, block_size: int) -> int:
    return -(-ctx_len // block_size)
