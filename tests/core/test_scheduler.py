from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams


def make_scheduler(num_blocks=100, block_size=4, budget=16, max_seqs=8, chunked=True, caching=True, mixed=None):
    kv = KVCacheManager(num_blocks, block_size, caching)
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                          max_mixed_prefill_tokens=mixed, preemption_mode="recompute")
    return Scheduler(config, 1000, kv)


def req(rid, n_prompt, max_tokens=4, base=0, **params):
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_id=None)


def run_step(sched, token=7):
    out = sched.schedule()
    sampled = {s.request_id: token for s in out.scheduled if s.samples}
    finished = sched.update_from_output(out, sampled)
    return out, finished


def test_chunked_prefill_splits_long_prompts_and_mixes_with_decodes():
    sched = make_scheduler(budget=8)
    sched.add_request(req("a", 3, base=100))
    sched.add_request(req("b", 20, base=200))
    out, _ = run_step(sched)
    assert [(s.request_id, s.start_position, s.num_new_tokens) for s in out.scheduled] == [("a", 0, 3), ("b", 0, 5)]
    assert [s.samples for s in out.scheduled] == [True, False]
    out, _ = run_step(sched)
    # a decodes (1 token), b takes the remaining 7 of the budget; decodes come first.
    assert [(s.request_id, s.start_position, s.num_new_tokens) for s in out.scheduled] == [("a", 3, 1), ("b", 5, 7)]
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [("a", 1, True), ("b", 1, True)]


def test_steps_that_decode_take_at_most_the_mixed_prefill_cap_of_prompt_tokens():
    sched = make_scheduler(budget=16, mixed=6)
    sched.add_request(req("a", 10, max_tokens=20, base=100))
    sched.add_request(req("b", 30, base=200))
    out, _ = run_step(sched)
    # Nothing decodes yet: the prompts share the whole budget.
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 10), ("b", 6)]
    sched.add_request(req("c", 8, base=300))
    for start in (6, 12, 18):
        out, _ = run_step(sched)
        # a decodes; b's chunk is cut to the cap although the budget has room, and c waits for the cap.
        assert [(s.request_id, s.start_position, s.num_new_tokens) for s in out.scheduled] == [
            ("a", 9 + start // 6, 1), ("b", start, 6)]
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 6)]
    out, _ = run_step(sched)  # b decodes now too; c's prompt gets the cap
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1), ("c", 6)]


def test_without_chunking_the_mixed_prefill_cap_does_not_cut_prompts():
    sched = make_scheduler(budget=16, chunked=False, mixed=4)
    sched.add_request(req("a", 3, max_tokens=10, base=100))
    run_step(sched)
    sched.add_request(req("b", 10, base=200))
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 10)]


def test_without_chunking_a_prompt_over_budget_waits():
    sched = make_scheduler(budget=8, chunked=False)
    sched.add_request(req("a", 3))
    sched.add_request(req("b", 6, base=50))
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]


def test_finished_requests_free_blocks_in_the_same_step():
    sched = make_scheduler()
    sched.add_request(req("a", 4, max_tokens=2))
    run_step(sched)
    assert sched.kv_cache.usage > 0
    out, finished = run_step(sched)
    assert [r.request_id for r in finished] == ["a"]
    assert finished[0].status == RequestStatus.FINISHED_LENGTH
    assert finished[0].output_token_ids == [7, 7]
    assert sched.kv_cache.usage == 0 and not sched.has_unfinished_requests()
    assert sched.schedule().finished_ids == ["a"]


def test_stop_token_and_min_tokens():
    sched = make_scheduler()
    r = req("a", 4, max_tokens=10, stop_token_ids=[7], min_tokens=2)
    sched.add_request(r)
    run_step(sched)  # first output token 7 is below min_tokens: continues
    assert not r.is_finished
    _, finished = run_step(sched)
    assert finished == [r] and r.stop_reason == 7 and r.status == RequestStatus.FINISHED_STOPPED


def test_eos_ends_unless_ignored():
    sched = make_scheduler()
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=5), eos_token_id=7)
    b = Request("b", [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True), eos_token_id=7)
    sched.add_request(a)
    sched.add_request(b)
    _, finished = run_step(sched)
    assert finished == [a]


def test_preemption_frees_the_newest_and_recomputes_it_later():
    # 6 blocks of 4 tokens; each request needs 2 blocks for its prompt and grows.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False)
    reqs = [req(f"r{i}", 8, max_tokens=6, base=10 * i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1", "r2"]
    assert sched.kv_cache.num_free_blocks == 0
    # Each needs a third block to decode: r2 (newest) is preempted to make room for r0.
    out, _ = run_step(sched)
    assert out.preempted_ids == ["r2", "r1"] or out.preempted_ids == ["r2"]
    assert reqs[2].status == RequestStatus.PREEMPTED and reqs[2].num_computed_tokens == 0
    assert sched.waiting[0] is reqs[2] or sched.waiting[0] is reqs[1]
    assert sched.num_preemptions >= 1
    # Everything eventually finishes with exactly max_tokens tokens and all blocks free.
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        run_step(sched)
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 6 for r in reqs)
    assert sched.kv_cache.num_free_blocks == 6


def test_preempted_request_recomputes_prompt_and_outputs():
    sched = make_scheduler(num_blocks=3, block_size=4, budget=64, caching=False)
    a = req("a", 4, max_tokens=8)
    b = req("b", 4, max_tokens=8, base=50)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # both prefilled: 2 blocks used, both have 1 output token (5 tokens each)
    out, _ = run_step(sched)  # both need a second block: only one free -> b preempted
    assert out.preempted_ids == ["b"]
    assert [s.request_id for s in out.scheduled] == ["a"]
    # Once a finishes, b comes back computing all 5 of its known tokens in one go.
    while a.status != RequestStatus.FINISHED_LENGTH:
        out, _ = run_step(sched)
    out, _ = run_step(sched)
    item = next(s for s in out.scheduled if s.request_id == "b")
    assert (item.start_position, item.num_new_tokens, item.samples) == (0, 5, True)


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_seqs=2)
    for i in range(3):
        sched.add_request(req(f"r{i}", 2, base=10 * i))
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert len(sched.waiting) == 1


def test_abort_frees_blocks_of_running_and_waiting():
    sched = make_scheduler(max_seqs=1)
    sched.add_request(req("a", 6))
    sched.add_request(req("b", 6, base=30))
    run_step(sched)
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache.usage == 0 and not sched.has_unfinished_requests()


def test_prefix_cache_hit_starts_the_count_ahead():
    sched = make_scheduler(block_size=4, budget=64)
    sched.add_request(req("a", 10, max_tokens=1))
    run_step(sched)
    sched.add_request(req("b", 10, max_tokens=1))
    out, _ = run_step(sched)
    item = out.scheduled[0]
    assert (item.start_position, item.num_new_tokens) == (8, 2)
    assert sched.step_request(item.request_id).num_cached_tokens == 8


class _GrammarDoneAfter:
    """A stand-in grammar state: complete once `limit` tokens were accepted (the runner feeds them)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.accepted = limit, 0

    def is_terminated(self) -> bool:
        return self.accepted >= self.limit


def test_a_complete_grammar_stops_its_sequence_even_before_min_tokens():
    sched = make_scheduler()
    grammar = _GrammarDoneAfter(2)
    request = req("a", 4, max_tokens=10, min_tokens=5)
    request.structured_output = grammar
    sched.add_request(request)
    sched.add_request(req("b", 4, max_tokens=10, base=50))
    _, finished = run_step(sched)
    grammar.accepted = 1
    assert finished == []
    grammar.accepted = 2  # the runner accepted the token this step samples
    _, finished = run_step(sched)
    assert [(r.request_id, r.status, r.stop_reason, r.output_token_ids) for r in finished] == \
        [("a", RequestStatus.FINISHED_STOPPED, None, [7, 7])]
    assert [r.request_id for r in sched.running] == ["b"]
    assert sched.kv_cache.num_free_blocks == 100 - 2  # a's blocks are back; b holds its two


def test_forced_tokens_are_appended_after_the_sampled_one_and_stop_like_it():
    sched = make_scheduler()
    sched.add_request(req("a", 4, max_tokens=5))
    out = sched.schedule()
    finished = sched.update_from_output(out, {"a": 7}, {"a": [20, 21]})
    assert finished == [] and sched.running[0].output_token_ids == [7, 20, 21]
    # The next step computes the sampled token and both forced ones as one chunk.
    out = sched.schedule()
    assert [(s.start_position, s.num_new_tokens, s.samples) for s in out.scheduled] == [(4, 3, True)]
    # max_tokens (5) cuts the forced run short: the rest is dropped and the request ends.
    finished = sched.update_from_output(out, {"a": 8}, {"a": [30, 31, 32]})
    assert [(r.request_id, r.status, r.output_token_ids) for r in finished] == \
        [("a", RequestStatus.FINISHED_LENGTH, [7, 20, 21, 8, 30])]


def test_speculative_drafts_are_verified_as_one_catch_up_and_rejected_ones_roll_back():
    sched = make_scheduler(block_size=4, budget=16)
    a = req("a", 5, max_tokens=10)
    sched.add_request(a)
    run_step(sched)  # prefill; samples token 7
    assert (a.num_computed_tokens, a.num_tokens) == (5, 6)
    a.spec_token_ids = [30, 31, 32]
    out = sched.schedule()
    (item,) = out.scheduled
    # The last token and three drafts: positions 5..8, one catch-up of 4, with blocks for all of them.
    assert (item.start_position, item.num_new_tokens, item.spec_token_ids) == (5, 4, [30, 31, 32])
    assert item.token_ids == [7] and item.spec_token_ids == [30, 31, 32] and item.samples
    assert len(sched.kv_cache.block_ids("a")) == 3 and a.spec_token_ids == []  # 9 positions in blocks of 4
    assert item.new_block_ids == sched.kv_cache.block_ids("a")[2:]  # the runner already holds the first two
    # Drafts 30, 31 kept, 32 rejected; 40 is the token sampled after 31.
    sched.update_from_output(out, {"a": 40}, accepted={"a": [30, 31]})
    assert a.output_token_ids == [7, 30, 31, 40]
    assert (a.num_computed_tokens, a.num_tokens) == (8, 9)  # position 8 (draft 32's KV) is recomputed
    assert (sched.num_draft_tokens, sched.num_accepted_tokens) == (3, 2)
    out = sched.schedule()
    assert [(s.start_position, s.num_new_tokens, s.token_ids) for s in out.scheduled] == [(8, 1, [40])]


def test_drafts_are_capped_by_max_tokens_and_budget_and_a_stop_inside_them_ends_the_request():
    sched = make_scheduler(budget=3)
    a = req("a", 2, max_tokens=4, stop_token_ids=[31])
    sched.add_request(a)
    run_step(sched)
    a.spec_token_ids = [30, 31, 32, 33, 34]
    out = sched.schedule()
    # Budget 3: the last token and two drafts (max_tokens alone would allow 4 - 1 - 1 = 2 as well).
    assert out.scheduled[0].spec_token_ids == [30, 31]
    finished = sched.update_from_output(out, {"a": 50}, accepted={"a": [30, 31]})
    assert finished == [a] and a.output_token_ids == [7, 30, 31] and a.stop_reason == 31
    assert sched.kv_cache.usage == 0.0
    sched2 = make_scheduler(budget=16)
    b = req("b", 2, max_tokens=3)
    sched2.add_request(b)
    run_step(sched2)
    b.spec_token_ids = [30, 31, 32]
    assert sched2.schedule().scheduled[0].spec_token_ids == [30]  # 1 output so far: room for 1 draft + 1 token
