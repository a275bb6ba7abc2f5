"""The runner's own request state: built from NewRequestData once, then kept current by deltas."""
from __future__ import annotations

import torch

from tokenmill.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from tokenmill.runner.input_batch import InputBatch, build_model_inputs, step_rows
from tokenmill.sampling_params import SamplingParams

BLOCK = 4


def _new(rid: str, prompt: list[int], outputs: list[int] = ()) -> NewRequestData:
    return NewRequestData(rid, prompt, SamplingParams(max_tokens=8), output_token_ids=list(outputs))


def test_deltas_keep_tokens_and_block_tables_current_and_rows_are_reused():
    batch = InputBatch(max_blocks_per_request=8)
    # Step 1: a 6-token prompt in one chunk, blocks 3 and 5.
    states = batch.update(SchedulerOutput(new_requests=[_new("a", [1, 2, 3, 4, 5, 6])],
                                          scheduled=[ScheduledRequest("a", 0, 6, [1, 2, 3, 4, 5, 6], [3, 5])]))
    a = states[0]
    assert a.block_ids == [3, 5] and list(batch.block_table[a.row, :2]) == [3, 5]
    # Step 2: decode of sampled token 9 at position 6 (no new block); then 10 and 11 need block 7.
    batch.update(SchedulerOutput(scheduled=[ScheduledRequest("a", 6, 1, [9], [], samples=True)]))
    batch.update(SchedulerOutput(scheduled=[ScheduledRequest("a", 7, 1, [10], [7], samples=True)]))
    assert a.token_ids == [1, 2, 3, 4, 5, 6, 9, 10] and a.block_ids == [3, 5, 7]
    assert list(batch.block_table[a.row, :3]) == [3, 5, 7]
    # A verify with drafts 20, 21 whose second is rejected: the next chunk starts where kept tokens end.
    batch.update(SchedulerOutput(scheduled=[ScheduledRequest("a", 8, 3, [11], [], samples=True,
                                                             spec_token_ids=[20, 21])]))
    assert a.token_ids[8:] == [11, 20, 21]
    batch.update(SchedulerOutput(scheduled=[ScheduledRequest("a", 10, 1, [30], [9], samples=True)]))
    assert a.token_ids[8:] == [11, 20, 30]
    # Finished: its row goes to the next new request, whose table is written from its own blocks.
    row = a.row
    states = batch.update(SchedulerOutput(finished_ids=["a"], new_requests=[_new("b", [7, 7], outputs=[8])],
                                          scheduled=[ScheduledRequest("b", 0, 3, [7, 7, 8], [2])]))
    assert "a" not in batch.requests and states[0].row == row and batch.block_table[row, 0] == 2


def test_decode_block_tables_gathered_from_the_persistent_table_equal_built_ones():
    batch = InputBatch(max_blocks_per_request=8)
    news = [_new("x", list(range(9))), _new("y", list(range(3)))]
    batch.update(SchedulerOutput(new_requests=news, scheduled=[
        ScheduledRequest("x", 0, 9, list(range(9)), [4, 1, 6]), ScheduledRequest("y", 0, 3, [0, 1, 2], [2])]))
    scheduled = [ScheduledRequest("x", 9, 1, [5], [], samples=True), ScheduledRequest("y", 3, 1, [6], [], samples=True)]
    states = batch.update(SchedulerOutput(scheduled=scheduled))
    rows = step_rows(scheduled, states)
    gathered = build_model_inputs(rows, BLOCK, torch.device("cpu"), False, batch.block_table).meta
    built = build_model_inputs(rows, BLOCK, torch.device("cpu"), False, None).meta
    assert torch.equal(gathered.decode_context_lens, built.decode_context_lens)
    # Rows are ordered by context length; compare the blocks each row may read.
    for table_row, length in zip(range(2), built.decode_context_lens.tolist()):
        n = -(-length // BLOCK)
        assert torch.equal(gathered.decode_block_tables[table_row, :n], built.decode_block_tables[table_row, :n])
