"""The runner's persistent input batch: built from NewRequestData once, then kept current by deltas."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from tokenmill.model.layers.attention import TorchAttentionBackend
from tokenmill.runner.input_batch import InputBatch
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
CPU = torch.device("cpu")


def _new(rid: str, prompt: list[int], outputs: list[int] = (), **params) -> NewRequestData:
    return NewRequestData(rid, prompt, SamplingParams(max_tokens=8, **params), output_token_ids=list(outputs))


def _tokens(batch: InputBatch, rid: str, end: int) -> list[int]:
    return batch.token_ids[batch.requests[rid].row, :end].tolist()


def test_deltas_keep_tokens_and_block_tables_current_and_rows_are_reused():
    batch = InputBatch(max_model_len=32, block_size=BLOCK)
    # Step 1: a 6-token prompt in one chunk, blocks 3 and 5.
    states = batch.update(SchedulerOutput(new_requests=[_new("a", [1, 2, 3, 4, 5, 6])],
                                          scheduled=[ScheduledRequest("a", 0, 6, [1, 2, 3, 4, 5, 6], [3, 5])]))
    a = states[0]
    assert a.num_blocks == 2 and list(batch.block_table[a.row, :2]) == [3, 5]
    # Step 2: decode of sampled token 9 at position 6 (no new block); then 10 and 11 need block 7.
    batch.update(SchedulerOutput(scheduled=[ScheduledRequest("a", 6, 1, [9], [], samples=True)]))
    batch.update(SchedulerOutput(scheduled=[ScheduledRequest("a", 7, 1, [10], [7], samples=True)]))
    assert _tokens(batch, "a", 8) == [1, 2, 3, 4, 5, 6, 9, 10] and a.num_blocks == 3
    assert list(batch.block_table[a.row, :3]) == [3, 5, 7]
    assert batch.output_tokens(a, 8).tolist() == [9, 10]
    # A verify with drafts 20, 21 whose second is rejected: the next chunk starts where kept tokens end.
    batch.update(SchedulerOutput(scheduled=[ScheduledRequest("a", 8, 3, [11], [], samples=True,
                                                             spec_token_ids=[20, 21])]))
    assert _tokens(batch, "a", 11)[8:] == [11, 20, 21]
    batch.update(SchedulerOutput(scheduled=[ScheduledRequest("a", 10, 1, [30], [9], samples=True)]))
    assert _tokens(batch, "a", 11)[8:] == [11, 20, 30]
    # Finished: its row goes to the next new request, whose tokens and table are written from its own data.
    row = a.row
    states = batch.update(SchedulerOutput(finished_ids=["a"], new_requests=[_new("b", [7, 7], outputs=[8])],
                                          scheduled=[ScheduledRequest("b", 0, 3, [7, 7, 8], [2])]))
    assert "a" not in batch.requests and states[0].row == row and batch.block_table[row, 0] == 2
    assert _tokens(batch, "b", 3) == [7, 7, 8]


def test_rows_grow_past_the_initial_capacity_and_keep_their_contents():
    batch = InputBatch(max_model_len=8, block_size=BLOCK, max_num_reqs=2)
    news = [_new(f"r{i}", [i + 1, i + 2], temperature=0.5 + i) for i in range(5)]
    scheduled = [ScheduledRequest(f"r{i}", 0, 2, [i + 1, i + 2], [i]) for i in range(5)]
    states = batch.update(SchedulerOutput(new_requests=news, scheduled=scheduled))
    assert len({s.row for s in states}) == 5 and batch.token_ids.shape[0] >= 5
    for i, state in enumerate(states):
        assert _tokens(batch, f"r{i}", 2) == [i + 1, i + 2] and batch.block_table[state.row, 0] == i
    arrays = batch.sampling_arrays([states[4].row, states[0].row])
    assert arrays.temperature.tolist() == [4.5, 0.5]


def test_prepared_inputs_gather_ids_positions_and_slots_from_the_rows():
    """A mixed step: two decodes (ordered by context length) then a prefill chunk after cached context."""
    batch = InputBatch(max_model_len=32, block_size=BLOCK, num_groups=2)
    news = [_new("x", list(range(100, 109))), _new("y", list(range(200, 203))), _new("z", list(range(300, 312)))]
    first = [ScheduledRequest("x", 0, 9, list(range(100, 109)), [4, 1, 6], more_group_block_ids=[[14, 11, 16]]),
             ScheduledRequest("y", 0, 3, [200, 201, 202], [2], more_group_block_ids=[[12]]),
             ScheduledRequest("z", 0, 8, list(range(300, 308)), [8, 9], more_group_block_ids=[[18, 19]])]
    batch.update(SchedulerOutput(new_requests=news, scheduled=first))
    step = [ScheduledRequest("x", 9, 1, [5], [], samples=True),
            ScheduledRequest("y", 3, 1, [6], [], samples=True),
            ScheduledRequest("z", 8, 4, list(range(308, 312)), [3], samples=True, more_group_block_ids=[[13]])]
    states = batch.update(SchedulerOutput(scheduled=step))
    inputs = batch.prepare(step, states, CPU, paged_decode=True)
    # y (context 4) before x (context 10), then z's chunk 8..11.
    assert inputs.input_ids.tolist() == [6, 5, 308, 309, 310, 311]
    assert inputs.positions.tolist() == [3, 9, 8, 9, 10, 11]
    assert inputs.last_token_index == [1, 0, 5]
    assert len(inputs.attention) == 2  # one layout per KV cache group
    assert inputs.attention[0].slot_mapping.tolist() == [2 * 4 + 3, 6 * 4 + 1, 3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2,
                                                         3 * 4 + 3]
    assert inputs.attention[1].slot_mapping.tolist() == [12 * 4 + 3, 16 * 4 + 1, 13 * 4, 13 * 4 + 1, 13 * 4 + 2,
                                                         13 * 4 + 3]
    layout = inputs.attention[0]
    assert layout.num_decodes == 2 and layout.decode_context_lens.tolist() == [4, 10]
    assert layout.decode_block_table[0, :1].tolist() == [2] and layout.decode_block_table[1, :3].tolist() == [4, 1, 6]
    assert layout.prefill_query_ranges == [(2, 6)] and layout.prefill_context_lens == [12]
    assert layout.prefill_block_ids[0].tolist() == [8, 9, 3]
    # The torch backend's buckets read the same tables.
    bucketed = TorchAttentionBackend().prepare_metadata(batch.prepare(step, states, CPU).attention[0])
    bucket = bucketed.decode_buckets[0]
    assert bucket.max_blocks == 3 and bucket.block_ids.view(2, 3)[1].tolist() == [4, 1, 6]
    assert bucket.block_ids.view(2, 3)[0, 0].item() == 2
    assert bucket.mask.view(2, -1).sum(dim=1).tolist() == [4, 10]


def test_a_verify_is_one_decode_row_per_position_with_block_tables():
    batch = InputBatch(max_model_len=32, block_size=BLOCK)
    batch.update(SchedulerOutput(new_requests=[_new("v", [1, 2, 3, 4, 5])],
                                 scheduled=[ScheduledRequest("v", 0, 5, [1, 2, 3, 4, 5], [7, 3])]))
    step = [ScheduledRequest("v", 5, 3, [9], [], samples=True, spec_token_ids=[10, 11])]
    states = batch.update(SchedulerOutput(scheduled=step))
    layout = batch.prepare(step, states, CPU, paged_decode=True).attention[0]
    assert layout.num_decodes == 3 and layout.decode_context_lens.tolist() == [6, 7, 8]
    assert np.array_equal(layout.decode_block_table, np.array([[7, 3]] * 3, dtype=np.int32))
    assert batch.prepare(step, states, CPU, paged_decode=False).attention[0].prefill_query_ranges == [(0, 3)]
