from __future__ import annotations

import pytest

from tokenmill.core.block_pool import BlockPool


def test_new_blocks_come_from_the_head_in_id_order():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 3
    assert pool.free_queue.block_ids() == [3, 4, 5]


def test_uncached_blocks_return_to_the_head_cached_to_the_tail():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(b, b"hash-b")
    pool.free_blocks([a, b, c])
    # a and c are uncached (head, most recently freed first); b holds a prefix (tail).
    assert pool.free_queue.block_ids() == [2, 0, 3, 1]


def test_lru_eviction_order_of_cached_blocks():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, f"h{i}".encode())
    pool.free_blocks([blocks[1]])
    pool.free_blocks([blocks[0]])
    pool.free_blocks([blocks[2]])
    assert pool.free_queue.block_ids() == [1, 0, 2]
    first = pool.get_new_blocks(1)[0]
    assert first.block_id == 1 and first.block_hash is None
    assert pool.get_cached_block(b"h1") is None
    assert pool.get_cached_block(b"h0") is blocks[0]
    assert pool.num_evictions == 1


def test_touch_revives_a_free_cached_block_and_counts_refs():
    pool = BlockPool(3)
    block = pool.get_new_blocks(1)[0]
    pool.cache_full_block(block, b"x")
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    assert 0 not in pool.free_queue.block_ids()
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([block])
    assert pool.free_queue.block_ids()[-1] == 0


def test_double_free_raises_and_overallocation_raises():
    pool = BlockPool(2)
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"same")
    pool.cache_full_block(b, b"same")
    assert pool.get_cached_block(b"same") is a
    assert b.block_hash is None


def test_usage():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert pool.usage == 0.5
    pool.free_blocks(blocks)
    assert pool.usage == 0.0
