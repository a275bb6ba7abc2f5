"""Prefix caching at block level: hits and misses, the exact eviction order, reference counts under
fork, copy-on-write of the partial block, no leaked block after finish or abort, beam parking, and
the lpm policy. Pure Python: the Scheduler and KVCacheManager driven with fake sampled tokens."""
from __future__ import annotations

import time

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams

BS = 4  # block size of every test here


def make_request(rid: str, tokens: list[int], max_tokens: int = 4, **kw) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), eos_token_id=None, **kw)


def make_scheduler(num_blocks: int = 32, *, policy: str = "fcfs", max_seqs: int = 8, budget: int = 64,
                   lpm_max_wait: float = 5.0) -> Scheduler:
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, scheduling_policy=policy,
                          lpm_max_wait=lpm_max_wait, preemption_mode="recompute")
    return Scheduler(config, 1000, KVCacheManager(num_blocks, BS))


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    finished = sched.update_from_output(out, {s.request_id: token for s in out.scheduled if s.samples})
    return out, finished


def drain(sched: Scheduler, limit: int = 200) -> list:
    outputs = []
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            return outputs
        outputs.append(step(sched)[0])
    raise AssertionError("the scheduler did not drain")


def assert_no_leak(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv.req_to_blocks and not kv.num_cached_blocks


# ---- hits, misses, eviction ----------------------------------------------------------------
def test_hit_and_miss_counts_and_blocks():
    kv = KVCacheManager(16, BS)
    a = make_request("a", range(10))  # blocks 0, 1 full (cached), 2 partial
    kv.allocate_slots(a, 10)
    same_prefix = make_request("b", list(range(8)) + [90, 91, 92])
    hits, num_cached = kv.get_computed_blocks(same_prefix)
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8
    other = make_request("c", [50] + list(range(1, 12)))  # first block differs: the chain misses
    assert kv.get_computed_blocks(other) == ([], 0)
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (11 + 12, 8)
    # Taking the hits bumps the ref counts of the shared blocks only.
    kv.allocate_slots(same_prefix, 3, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [2, 2, 1, 1]


def test_exact_eviction_order_lru_tail_blocks_first():
    kv = KVCacheManager(6, BS)
    a = make_request("a", range(8))  # blocks 0, 1
    b = make_request("b", range(100, 108))  # blocks 2, 3
    kv.allocate_slots(a, 8)
    kv.allocate_slots(b, 8)
    kv.free(a)
    kv.free(b)
    # Never-used blocks first, then a's (freed before b's), each request tail block first.
    assert kv.pool.free_queue.block_ids() == [4, 5, 1, 0, 3, 2]
    assert kv.pool.num_evictions == 0
    # A hit on a's prefix revives blocks 0, 1; freeing them again makes them most recently used.
    a2 = make_request("a2", list(range(8)) + [9])
    hits, _ = kv.get_computed_blocks(a2)
    kv.allocate_slots(a2, 1, hits)
    assert kv.block_ids("a2") == [0, 1, 4]
    kv.free(a2)
    assert kv.pool.free_queue.block_ids() == [4, 5, 3, 2, 1, 0]
    # 4 new blocks: the uncached 4, 5 first, then b's tail block 3, then b's head block 2.
    c = make_request("c", range(200, 216))
    kv.allocate_slots(c, 16)
    assert kv.block_ids("c") == [4, 5, 3, 2]
    assert kv.pool.num_evictions == 2
    assert kv.get_computed_blocks(make_request("b2", range(100, 109)))[1] == 0  # b evicted
    assert kv.get_computed_blocks(make_request("a3", range(9)))[1] == 8  # a survived


def test_partial_eviction_keeps_the_head_of_the_chain():
    kv = KVCacheManager(4, BS)
    a = make_request("a", range(12))  # 3 full blocks 0, 1, 2
    kv.allocate_slots(a, 12)
    kv.free(a)
    kv.allocate_slots(make_request("x", range(500, 506)), 6)  # needs 2: the uncached 3, then a's tail 2
    assert kv.block_ids("x") == [3, 2] and kv.pool.num_evictions == 1
    hits, num_cached = kv.get_computed_blocks(make_request("a2", range(13)))
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8


# ---- fork and copy-on-write --------------------------------------------------------------
def test_fork_ref_counts_and_copy_on_write_of_the_partial_block():
    kv = KVCacheManager(8, BS)
    parent = make_request("p", range(10))
    kv.allocate_slots(parent, 10)  # blocks 0, 1 (full), 2 (2 of 4 slots used)
    parent.num_computed_tokens = 10
    children = [make_request(f"c{i}", list(range(10)) + [40 + i]) for i in range(3)]
    for child in children:
        kv.fork(parent, child)
        child.num_computed_tokens = 10
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [4, 4, 4]
    kv.free(parent)
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [3, 3, 3]
    assert all(kv.block_ids(c.request_id) == [0, 1, 2] for c in children)
    # c0 writes slot 10 into the shared partial block 2: it gets a private copy (block 3) first.
    assert kv.allocate_slots(children[0], 1) == []
    assert kv.block_ids("c0") == [0, 1, 3] and kv.pending_copies == [(2, 3)]
    kv.allocate_slots(children[1], 1)
    assert kv.block_ids("c1") == [0, 1, 4] and kv.pending_copies == [(2, 3), (2, 4)]
    # The last sharer owns block 2 alone now: it writes in place, no copy.
    kv.allocate_slots(children[2], 1)
    assert kv.block_ids("c2") == [0, 1, 2] and kv.pending_copies == [(2, 3), (2, 4)]
    assert [b.ref_cnt for b in kv.pool.blocks[:5]] == [3, 3, 1, 1, 1]
    assert kv.take_pending_copies() == [(2, 3), (2, 4)] and kv.pending_copies == []
    for child in children:
        kv.free(child)
    assert_no_leak(kv)


def test_fork_at_a_block_boundary_copies_nothing():
    kv = KVCacheManager(8, BS)
    parent = make_request("p", range(8))
    kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    child = make_request("c", list(range(8)) + [1])
    kv.fork(parent, child)
    child.num_computed_tokens = 8
    assert [b.block_id for b in kv.allocate_slots(child, 1)] == [2]
    assert kv.pending_copies == [] and kv.block_ids("c") == [0, 1, 2]


def test_n_samples_fork_through_the_scheduler_and_copy_once_per_extra_sample():
    sched = make_scheduler(16)
    prompt = list(range(10))  # the parent computes 9 tokens: blocks 0, 1 and 1 slot of block 2
    children = [make_request(f"r#{i}", prompt, max_tokens=3) for i in range(3)]
    parent = make_request("r#prompt", prompt, fork_children=children)
    sched.add_request(parent)
    out, _ = step(sched)
    assert [(s.request_id, s.start_position, s.num_new_tokens, s.samples) for s in out.scheduled] == \
        [("r#prompt", 0, 9, False)]
    out, _ = step(sched)
    # The samples compute only the last prompt token; two of them copy the shared partial block 2.
    assert [(s.request_id, s.start_position, s.num_new_tokens) for s in out.scheduled] == \
        [("r#0", 9, 1), ("r#1", 9, 1), ("r#2", 9, 1)]
    assert out.block_copies == [(2, 3), (2, 4)]
    assert [sched.kv_cache.block_ids(s.request_id) for s in out.scheduled] == [[0, 1, 3], [0, 1, 4], [0, 1, 2]]
    # The samples are new to the runner: each is described once, with its whole block table.
    assert [n.request_id for n in out.new_requests] == ["r#0", "r#1", "r#2"]
    assert [s.new_block_ids for s in out.scheduled] == [[0, 1, 3], [0, 1, 4], [0, 1, 2]]
    assert "r#prompt" in out.finished_ids  # the runner drops the parent's state
    assert parent.status == RequestStatus.FINISHED_STOPPED and "r#prompt" not in sched.kv_cache.req_to_blocks
    drain(sched)
    assert all(c.num_output_tokens == 3 for c in children)
    assert_no_leak(sched.kv_cache)


def test_a_parked_beam_holds_its_blocks_until_its_children_are_set():
    sched = make_scheduler(16)
    beam = make_request("b0", range(6), max_tokens=10)
    sched.add_request(beam)
    step(sched)  # computes 6 tokens (blocks 0, 1) and samples token 7
    beam.fork_children = []  # parked, as beam search does after reading the logprobs
    for _ in range(3):
        out, _ = step(sched)
        assert out.scheduled == [] and sched.kv_cache.block_ids("b0") == [0, 1]
    # Two continuations of the 6 computed tokens: both fork from the beam, one copies block 1.
    kids = [make_request(f"b{i}", list(range(6)) + [t], max_tokens=10) for i, t in ((1, 30), (2, 31))]
    beam.fork_children = kids
    out, _ = step(sched)
    assert [(s.request_id, s.start_position, s.num_new_tokens) for s in out.scheduled] == [("b1", 6, 1), ("b2", 6, 1)]
    assert out.block_copies == [(1, 2)]
    assert sched.kv_cache.block_ids("b1") == [0, 2] and sched.kv_cache.block_ids("b2") == [0, 1]
    sched.finish_requests(["b1", "b2"], RequestStatus.FINISHED_ABORTED)
    assert_no_leak(sched.kv_cache)


# ---- no leaks ----------------------------------------------------------------------------
def test_no_block_leaks_after_finish_and_abort_with_shared_prefixes():
    sched = make_scheduler(12, budget=8, max_seqs=3)
    shared = list(range(9))
    reqs = [make_request(f"r{i}", shared + [100 + i] * (i + 1), max_tokens=3 + i) for i in range(5)]
    forked_children = [make_request(f"n#{i}", shared, max_tokens=4) for i in range(2)]
    reqs.append(make_request("n#prompt", shared, fork_children=forked_children))
    for r in reqs:
        sched.add_request(r)
    step(sched)
    step(sched)
    # Abort one running and one waiting request mid-flight.
    running, waiting = sched.running[0].request_id, sched.waiting[-1].request_id
    sched.finish_requests([running, waiting], RequestStatus.FINISHED_ABORTED)
    drain(sched)
    assert sched.kv_cache.prefix_stats.hits > 0
    assert_no_leak(sched.kv_cache)
    # Finished prompts stay cached (free but reusable) until evicted.
    assert sched.kv_cache.pool.cached


# ---- lpm ---------------------------------------------------------------------------------
def test_lpm_runs_the_request_sharing_the_cached_prefix_first_within_the_wait_bound():
    sched = make_scheduler(32, policy="lpm", max_seqs=1, lpm_max_wait=30.0)
    prefix = list(range(12))
    sched.add_request(make_request("warm", prefix + [1], max_tokens=1))
    drain(sched)  # blocks of the prefix are cached now
    now = time.monotonic()
    cold = make_request("cold", range(300, 313), max_tokens=1, arrival_time=now - 1.0)
    hot = make_request("hot", prefix + [2], max_tokens=1, arrival_time=now)
    sched.add_request(cold)
    sched.add_request(hot)
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["hot"]  # younger, but 12 tokens cached
    assert (out.scheduled[0].start_position, hot.num_cached_tokens) == (12, 12)
    drain(sched)


def test_lpm_overdue_request_goes_first_regardless_of_prefix():
    sched = make_scheduler(32, policy="lpm", max_seqs=1, lpm_max_wait=5.0)
    prefix = list(range(12))
    sched.add_request(make_request("warm", prefix + [1], max_tokens=1))
    drain(sched)
    now = time.monotonic()
    cold = make_request("cold", range(300, 313), max_tokens=1, arrival_time=now - 10.0)  # waited > 5 s
    hot = make_request("hot", prefix + [2], max_tokens=1, arrival_time=now)
    sched.add_request(hot)
    sched.add_request(cold)
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["cold"]
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["hot"]
