"""With prefix caching on, outputs equal those with caching off, token for token (greedy, EOS
ignored), while the cache really serves the shared blocks: identical prompts, prompts sharing 3+
blocks then diverging (with chunked prefill), and a prefix evicted under memory pressure."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

BLOCK = 16
MAX_TOKENS = 12


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def ids(start: int, count: int) -> list[int]:
    """Deterministic, distinct-looking token ids well inside the vocabulary."""
    return [(start + 37 * i) % 40000 + 100 for i in range(count)]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def cacheable(prompt: list[int]) -> int:
    """The most prompt tokens a hit can cover: full blocks, leaving the last token to compute."""
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, enable_prefix_caching=False,
               max_num_batched_tokens=32, numerics="exact")


def test_identical_prompts(tiny_llama_dir, reference):
    prompt = ids(5, 45)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, numerics="exact")
    stats = llm.llm_engine.core.core.kv_cache.prefix_stats
    expected = tokens(run(reference, [prompt] * 3))
    # Submitted together: the first registers its blocks as it allocates them, so the next two hit in
    # the same step and read KV the same forward pass writes.
    outputs = run(llm, [prompt] * 3)
    assert tokens(outputs) == expected
    assert [o.num_cached_tokens for o in outputs] == [0, 32, 32]
    assert stats.hits == 64
    # Again later: a full hit, from blocks that were freed but stay cached.
    again = run(llm, [prompt])
    assert tokens(again) == expected[:1] and again[0].num_cached_tokens == cacheable(prompt) == 32
    assert stats.hits == 96 and stats.queries == 4 * 45


def test_shared_prefix_of_three_blocks_then_diverging(tiny_llama_dir, reference):
    prefix = ids(1000, 3 * BLOCK + 5)  # 53 tokens: 3 full blocks + 5
    prompts = [prefix + ids(7 + 11 * i, 4 + 9 * i) for i in range(4)]  # suffixes of 4..31 tokens
    expected = tokens(run(reference, prompts))
    # A budget of 32 tokens a step: prompts are chunked and hit blocks an earlier chunk registered.
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=32, numerics="exact")
    outputs = run(llm, prompts)
    assert tokens(outputs) == expected
    hits = [o.num_cached_tokens for o in outputs]
    assert hits[0] == 0 and all(h >= 3 * BLOCK for h in hits[1:])
    assert all(h <= cacheable(p) for h, p in zip(hits, prompts))
    assert llm.llm_engine.core.core.kv_cache.prefix_stats.hits == sum(hits)
    # The suffixes differ, so no hit reaches past the shared blocks.
    assert all(h == 3 * BLOCK for h in hits[1:])


def test_evicted_prefix_is_recomputed_correctly(tiny_llama_dir, reference):
    # 12 blocks of 16 tokens = 192 token slots.
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=12, max_model_len=192, numerics="exact")
    kv = llm.llm_engine.core.core.kv_cache
    a = ids(3, 60)  # 60 + 4 tokens -> blocks 0-2 full (cached), block 3 partial
    big = ids(20000, 170)  # 170 + 4 tokens -> 11 blocks
    expected_a, expected_big = tokens(run(reference, [a], 4)), tokens(run(reference, [big], 4))

    assert tokens(run(llm, [a], 4)) == expected_a
    again = run(llm, [a], 4)
    assert tokens(again) == expected_a and again[0].num_cached_tokens == 48
    assert kv.pool.num_evictions == 0

    # big needs 11 blocks; 9 are free and uncached, so 2 of a's 3 cached blocks are evicted: the tail
    # of its chain first, keeping block 0 (the least recently freed goes first, and a request's
    # blocks are freed tail first).
    out_big = run(llm, [big], 4)
    assert tokens(out_big) == expected_big and out_big[0].num_cached_tokens == 0
    assert kv.pool.num_evictions == 2

    hits_before = kv.prefix_stats.hits
    after = run(llm, [a], 4)
    assert tokens(after) == expected_a
    assert after[0].num_cached_tokens == 16  # only the head block survived
    assert kv.prefix_stats.hits - hits_before == 16
    assert kv.num_free_blocks == 12 and not llm.llm_engine.core.core.has_unfinished_requests()
