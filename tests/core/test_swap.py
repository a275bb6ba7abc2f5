"""Preemption by swapping KV blocks to host memory."""
from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams


def make_request(rid: str, n: int, base: int = 0, max_tokens: int = 8) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens))


def test_swap_out_and_in_move_blocks_between_pools():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False, num_host_blocks=4)
    req = make_request("a", 10)
    kv.allocate_slots(req, 10)
    req.num_computed_tokens = 10
    assert kv.block_ids("a") == [0, 1, 2] and kv.can_swap_out(req)
    kv.swap_out(req)
    assert kv.num_free_blocks == 6 and kv.num_free_host_blocks == 1
    out, back = kv.take_pending_swaps()
    assert out == [(0, 0), (1, 1), (2, 2)] and back == []
    other = make_request("b", 8, base=100)
    kv.allocate_slots(other, 8)  # takes device blocks 2, 1 (freed last, at the head)
    assert kv.can_swap_in(req)
    kv.swap_in(req)
    out, back = kv.take_pending_swaps()
    assert out == [] and [h for h, _ in back] == [0, 1, 2]
    assert [d for _, d in back] == kv.block_ids("a") and not set(kv.block_ids("a")) & set(kv.block_ids("b"))
    # Host blocks come back only after the copy that reads them was handed to the runner.
    assert kv.num_free_host_blocks == 4


def test_host_blocks_are_not_reused_in_the_step_that_reads_them():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False, num_host_blocks=3)
    a, b = make_request("a", 12), make_request("b", 4, base=50)
    kv.allocate_slots(a, 12)
    kv.swap_out(a)
    kv.take_pending_swaps()
    kv.allocate_slots(b, 4)
    kv.swap_in(a)
    assert not kv.can_swap_out(b)  # a's host blocks are still being read this step
    kv.take_pending_swaps()
    assert kv.can_swap_out(b)


def test_abort_of_a_swapped_request_frees_its_host_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False, num_host_blocks=4)
    req = make_request("a", 8)
    kv.allocate_slots(req, 8)
    kv.swap_out(req)
    kv.free(req)
    assert kv.num_free_host_blocks == 4 and kv.num_free_blocks == 4


def run_step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update_from_output(out, {s.request_id: 7 for s in out.scheduled if s.samples})
    return out


def test_scheduler_swaps_instead_of_recomputing_and_resumes_first():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False, num_host_blocks=8)
    config = EngineConfig(max_num_batched_tokens=64, preemption_mode="swap")
    sched = Scheduler(config, 100, kv)
    a, b = make_request("a", 4), make_request("b", 4, base=50)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # both prefilled; each holds 1 block, 1 block free
    out = run_step(sched)  # both need a second block: b is swapped out, keeping its computed tokens
    assert out.preempted_ids == ["b"] and b.status == RequestStatus.SWAPPED
    assert b.num_computed_tokens == 4 and sched.num_swap_outs == 1
    assert out.swap_out == [(1, 0)]
    c = make_request("c", 4, base=90)
    sched.add_request(c)
    for _ in range(50):
        if b.status != RequestStatus.SWAPPED:
            break
        out = run_step(sched)
        if "c" in [s.request_id for s in out.scheduled]:  # swapped requests come back first
            assert b.status == RequestStatus.RUNNING
    # b came back by a copy from host memory and continued with a decode, not a recompute.
    assert out.swap_in == [(0, out.swap_in[0][1])]
    item = next(s for s in out.scheduled if s.request_id == "b")
    assert (item.start_position, item.num_new_tokens) == (4, 1)
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        run_step(sched)
    assert [r.num_output_tokens for r in (a, b, c)] == [8, 8, 8]
    assert kv.num_free_blocks == 3 and kv.num_free_host_blocks == 8
