from __future__ import annotations

from tokenmill.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens))


def test_allocate_rounds_up_to_blocks_and_grows_on_demand():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", list(range(10)))
    new = kv.allocate_slots(req, 10)
    assert [b.block_id for b in new] == [0, 1, 2]
    req.num_computed_tokens = 10
    req.append_output_token(99)
    assert kv.allocate_slots(req, 1) == []  # slot 10 fits block 2
    req.num_computed_tokens = 11
    for t in (100, 101):
        req.append_output_token(t)
    new = kv.allocate_slots(req, 2)  # tokens 11, 12 -> block 3 needed
    assert [b.block_id for b in new] == [3]
    assert kv.block_ids("a") == [0, 1, 2, 3]


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = make_request("a", list(range(12)))
    assert kv.allocate_slots(req, 12) is None
    assert kv.num_free_blocks == 2 and "a" not in kv.req_to_blocks


def test_prefix_hit_reuses_blocks_and_leaves_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, True, True]
    # Same 12 tokens: at most 11 may come from the cache, so only 2 full blocks hit.
    b = make_request("b", list(range(12)))
    hits, num_cached = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8
    kv.allocate_slots(b, 4, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    assert kv.prefix_stats.queries == 12 and kv.prefix_stats.hits == 8


def test_diverging_prompt_hits_only_the_shared_prefix():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.allocate_slots(make_request("a", list(range(12))), 12)
    other = make_request("b", [0, 1, 2, 3, 4, 5, 6, 70, 8, 9, 10, 11, 12])
    hits, num_cached = kv.get_computed_blocks(other)
    assert [h.block_id for h in hits] == [0] and num_cached == 4


def test_chained_hash_depends_on_the_parent():
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(first, [3, 4]) == hash_block_tokens(first, [3, 4])


def test_free_returns_everything_and_cached_blocks_survive_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)  # blocks 0, 1 full (cached), block 2 partial
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    # Freed in reverse: partial block 2 to the head, then cached 1 and 0 to the tail.
    assert kv.pool.free_queue.block_ids() == [2, 3, 1, 0]
    b = make_request("b", list(range(9)))
    hits, num_cached = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8
    # A big request evicts cached blocks in LRU order: block 1 before block 0.
    c = make_request("c", [50 + i for i in range(12)])
    kv.allocate_slots(c, 12)
    assert kv.block_ids("c") == [2, 3, 1]
    assert kv.pool.get_cached_block(kv.pool.blocks[0].block_hash) is kv.pool.blocks[0]
    assert kv.pool.blocks[1].block_hash != a.block_hashes[1]


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    kv.allocate_slots(make_request("a", list(range(12))), 12)
    hits, num_cached = kv.get_computed_blocks(make_request("b", list(range(12))))
    assert hits == [] and num_cached == 0
    assert not kv.pool.cached
