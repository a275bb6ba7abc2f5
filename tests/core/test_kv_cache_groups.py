"""KV cache groups: which layers share a block table, and how a sliding-window group drops the blocks its
window has passed (null entries), keeps prefix hits correct, and stays bounded while the context grows."""
from __future__ import annotations

from tokenmill.core.kv_cache_groups import plan_kv_cache_groups
from tokenmill.core.kv_cache_manager import KVCacheManager, first_needed_block
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], max_tokens: int = 64) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def step(kv: KVCacheManager, req: Request, count: int, hits=()) -> None:
    """Allocate `count` tokens and count them as computed (sampling a token when the prompt is done)."""
    assert kv.allocate_slots(req, count, hits) is not None
    req.num_computed_tokens += len(hits) * kv.block_size + count
    if req.num_computed_tokens == req.num_tokens:
        req.append_output_token(1000 + req.num_tokens)


def test_gemma3_270m_layers_form_six_groups_of_three():
    # 18 layers, every sixth global (layer_types of Gemma3TextConfig's defaults).
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    layout = plan_kv_cache_groups(windows)
    assert [g.layers for g in layout.groups] == [(0, 1, 2), (3, 4, 6), (5, 11, 17), (7, 8, 9), (10, 12, 13),
                                                 (14, 15, 16)]
    assert layout.windows == (512, 512, None, 512, 512, 512) and layout.layers_per_group == 3
    assert layout.layer_group()[:7] == [0, 0, 0, 1, 1, 2, 1]
    assert layout.layer_tensor()[:7] == [0, 1, 2, 0, 1, 0, 2]


def test_uniform_models_stay_one_group():
    assert plan_kv_cache_groups([None] * 4).windows == (None,)
    mistral = plan_kv_cache_groups([4096] * 4)
    assert mistral.windows == (4096,) and mistral.groups[0].layers == (0, 1, 2, 3)


def test_first_needed_block():
    # window 6, block_size 4: a chunk from position 13 reads keys 8.. -> block 2 on.
    assert first_needed_block(13, 6, 4) == 2
    assert first_needed_block(5, 6, 4) == 0 and first_needed_block(6, 6, 4) == 0 and first_needed_block(9, 6, 4) == 1
    assert first_needed_block(100, None, 4) == 0


def test_window_drops_passed_blocks_under_chunked_prefill_and_decode():
    kv = KVCacheManager(num_blocks=12, block_size=4, group_windows=(6,))
    assert kv.null_block.block_id == 0 and kv.num_free_blocks == 11 and kv.usage == 0.0
    req = make_request("a", range(30))
    step(kv, req, 8)  # positions 0-7
    assert kv.block_ids("a") == [1, 2]
    step(kv, req, 8)  # positions 8-15: keys from 3 on, block 0 still needed
    assert kv.block_ids("a") == [1, 2, 3, 4]
    step(kv, req, 8)  # positions 16-23: keys from 11 on -> blocks 0 and 1 are behind the window
    assert kv.block_ids("a") == [0, 0, 3, 4, 5, 6]  # blocks 1, 2 are free but stay cached (LRU tail)
    assert kv.pool.free_queue.block_ids()[-2:] == [1, 2]
    assert kv.num_held_blocks("a") == [4]
    step(kv, req, 6)  # the rest of the prompt, then decodes far past the window
    for _ in range(40):
        step(kv, req, 1)
        assert kv.num_held_blocks("a")[0] <= 6 // 4 + 2
    # Every entry behind the window is the null block, and nothing leaked.
    held = kv.num_held_blocks("a")[0]
    assert kv.block_ids("a")[:-held] == [0] * (len(kv.block_ids("a")) - held)
    assert kv.num_free_blocks == 11 - held
    kv.free(req)
    assert kv.num_free_blocks == 11 and kv.usage == 0.0


def test_window_hit_needs_only_the_blocks_of_the_last_window():
    kv = KVCacheManager(num_blocks=16, block_size=4, group_windows=(6,))
    a = make_request("a", range(25))
    step(kv, a, 25)  # blocks 1-7, the 6 full ones cached
    step(kv, a, 1)  # decode at 25: keys from 20 on -> blocks 0-4 dropped (free, still cached)
    assert kv.block_ids("a")[:6] == [0, 0, 0, 0, 0, 6]
    # Evict the four oldest dropped blocks: uncached free blocks go first, then LRU order.
    uncached = kv.num_free_blocks - 5
    taker = make_request("t", range(500, 500 + 4 * (uncached + 4)))
    step(kv, taker, 4 * (uncached + 4))
    assert kv.pool.get_cached_block(a.block_hashes[4]) is not None
    assert all(kv.pool.get_cached_block(h) is None for h in a.block_hashes[:4])
    kv.free(taker)
    # A request with the same first 25 tokens: a hit at 24 needs keys 19.. = blocks 4 and 5, both cached.
    b = make_request("b", [*range(25), 7])
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 24
    assert [h.block_id for h in hits] == [0, 0, 0, 0, 5, 6]
    step(kv, b, 2, hits)
    assert kv.block_ids("b")[:6] == [0, 0, 0, 0, 5, 6] and kv.pool.blocks[6].ref_cnt == 2
    # With block 4 gone too, no window before any hit point is whole: no hit.
    kv.free(b)
    for block in kv.pool.get_new_blocks(kv.num_free_blocks):  # evicts every free cached block
        kv.pool.free_blocks([block])
    assert kv.get_computed_blocks(make_request("c", [*range(25), 7])) == ([], 0)


def test_mixed_groups_keep_global_blocks_and_drop_local_ones():
    kv = KVCacheManager(num_blocks=40, block_size=4, group_windows=(6, None))
    req = make_request("a", range(20))
    for _ in range(5):
        step(kv, req, 4)
    for _ in range(24):
        step(kv, req, 1)
        local, full = kv.num_held_blocks("a")
        assert local <= 6 // 4 + 2 and full == -(-req.num_computed_tokens // 4)
    assert len(kv.block_ids("a", 0)) == len(kv.block_ids("a", 1))  # one entry per block of tokens in each
    assert not set(kv.block_ids("a", 1)) & set(kv.block_ids("a", 0)) - {0}
    # A prefix hit takes the global group's whole prefix and the local group's last window.
    b = make_request("b", req.all_token_ids[:21])
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 20 and len(hits) == 5
    local_ids = [h[0].block_id for h in hits]
    assert local_ids[:3] == [0, 0, 0] and 0 not in local_ids[3:]
    assert [h[1].block_id for h in hits] == kv.block_ids("a", 1)[:5]
    # Forks share both tables; freeing everything returns every block.
    child = make_request("c", req.all_token_ids)
    kv.fork(req, child)
    kv.free(req)
    kv.free(child)
    assert kv.num_free_blocks == 39 and kv.usage == 0.0


def test_a_hit_in_a_later_group_is_never_handed_out_as_a_new_block():
    """Every group's hits leave the free queue before any group allocates: otherwise group 0's new block
    could be a free cached block that is group 1's hit, and both tables would point at it."""
    kv = KVCacheManager(num_blocks=10, block_size=4, group_windows=(None, None))
    a = make_request("a", range(8))
    step(kv, a, 8)
    assert kv.block_ids("a", 0) == [0, 1] and kv.block_ids("a", 1) == [2, 3]
    kv.free(a)
    holder = make_request("t", range(100, 112))
    step(kv, holder, 12)  # takes the six uncached blocks
    kv.pool.touch([kv.pool.blocks[0], kv.pool.blocks[1]])
    kv.pool.free_blocks([kv.pool.blocks[1], kv.pool.blocks[0]])  # group 0's hits to the tail
    assert kv.pool.free_queue.block_ids() == [3, 2, 1, 0]  # group 1's hits are evicted first
    kv.free(holder)
    b = make_request("b", [*range(8), 50])
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8 and [tuple(h.block_id for h in column) for column in hits] == [(0, 2), (1, 3)]
    step(kv, b, 1, hits)
    table0, table1 = kv.block_ids("b", 0), kv.block_ids("b", 1)
    assert table0[:2] == [0, 1] and table1[:2] == [2, 3]
    assert not set(table0) & set(table1) and len(set(table0 + table1)) == 6
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in table0 + table1)
    # The hits are still the prefix cache's: a third request with the same prefix finds them.
    assert kv.peek_cached_tokens(make_request("c", [*range(8), 60])) == 8
