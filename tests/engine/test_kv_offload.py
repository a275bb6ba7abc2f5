"""The prefix cache's second tier (--kv-offload-dir) in the engine: a prefix the memory cache lost, or that
an earlier engine computed, is read back instead of computed, and the outputs are the ones computing it
gives (HF transformers' own, token for token, in the exact mode); a changed setup or a damaged file is a
miss, never a wrong block."""
from __future__ import annotations

import pytest
import torch

from model_factory import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelLoadError

BLOCK = 16


def ids(start: int, count: int) -> list[int]:
    return [(start + 37 * i) % 40000 + 100 for i in range(count)]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int = 10):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def engine(llm: LLM):
    return llm.llm_engine.core.core


def make(model_dir, tier_dir, **kwargs) -> LLM:
    settings = dict(num_kv_blocks=64, max_model_len=512, numerics="exact", kv_offload_dir=str(tier_dir))
    return LLM(str(model_dir), **{**settings, **kwargs})


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=512, enable_prefix_caching=False,
               numerics="exact")


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def test_a_prefix_lost_from_memory_is_restored_and_matches_hf(tiny_llama_dir, tmp_path, reference, hf_model):
    prompts = [ids(5, 100), ids(5, 70) + ids(900, 20)]  # the second shares 4 blocks with the first
    expected = tokens(run(reference, prompts))
    assert expected[0] == hf_greedy(hf_model, prompts[0], 10)
    llm = make(tiny_llama_dir, tmp_path)
    core = engine(llm)
    assert tokens(run(llm, prompts[:1])) == expected[:1]
    assert core.kv_tier.flush()
    assert core.kv_tier.stats.blocks_written == 100 // BLOCK + 10 // BLOCK  # the prompt's and the output's full blocks
    assert core.kv_cache.reset_prefix_cache()  # the memory cache forgets; the tier does not
    outputs = run(llm, prompts)
    assert tokens(outputs) == expected
    assert outputs[0].outputs[0].token_ids == hf_greedy(hf_model, prompts[0], 10)
    assert [o.num_cached_tokens for o in outputs] == [96, 64]
    stats = core.scheduler.get_stats()
    assert stats.kv_offload["hits"] == 96 and stats.kv_offload["blocks_read"] == 6  # the second hit the memory copy
    assert stats.prefix_cache_hits == 64


def test_a_restarted_engine_hits_at_once_and_a_changed_setup_does_not(tiny_llama_dir, tmp_path, reference,
                                                                       tmp_path_factory, smollm2_tokenizer):
    prompt = ids(77, 150)
    expected = tokens(run(reference, [prompt]))
    first = make(tiny_llama_dir, tmp_path)
    assert tokens(run(first, [prompt])) == expected
    first.shutdown()  # writes what is queued
    restarted = make(tiny_llama_dir, tmp_path)
    outputs = run(restarted, [prompt])
    assert tokens(outputs) == expected and outputs[0].num_cached_tokens == 144
    assert engine(restarted).scheduler.get_stats().kv_offload["hits"] == 144
    from model_factory import build_tiny_llama

    other_weights = build_tiny_llama(tmp_path_factory.mktemp("other-weights"), smollm2_tokenizer, seed=1)
    for model, changed in ((tiny_llama_dir, dict(kv_cache_dtype="float16", numerics="auto")),
                           (tiny_llama_dir, dict(block_size=32)), (other_weights, {})):
        other = make(model, tmp_path, **changed)
        outputs = run(other, [prompt])
        assert outputs[0].num_cached_tokens == 0
        assert engine(other).scheduler.get_stats().kv_offload["hits"] == 0


def test_a_damaged_block_ends_the_restored_run(tiny_llama_dir, tmp_path, reference):
    prompt = ids(300, 120)
    expected = tokens(run(reference, [prompt]))
    first = make(tiny_llama_dir, tmp_path)
    run(first, [prompt])
    tier = engine(first).kv_tier
    assert tier.flush()
    keys = sorted(tier.root.glob("*/*.kv"), key=lambda p: p.stat().st_mtime_ns)
    # The blocks were written in order: flip a byte in the prompt's fourth block.
    victim = keys[3]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    restarted = make(tiny_llama_dir, tmp_path)
    outputs = run(restarted, [prompt])
    assert tokens(outputs) == expected
    assert outputs[0].num_cached_tokens == 3 * BLOCK
    assert engine(restarted).kv_tier.stats.corrupt == 1


def test_restores_under_memory_pressure_and_chunked_prefill(tiny_llama_dir, tmp_path, reference):
    """A cache of 12 blocks: each long prompt evicts the others' blocks from memory; coming back, they
    are read from the tier, in 32-token chunks mixed with other requests' decodes."""
    prompts = [ids(1000 * i, 90) for i in range(4)]
    expected = tokens(run(reference, prompts))
    llm = make(tiny_llama_dir, tmp_path, num_kv_blocks=12, max_model_len=192, max_num_batched_tokens=32)
    for prompt, want in zip(prompts, expected):
        assert tokens(run(llm, [prompt])) == [want]
    engine(llm).kv_tier.flush()
    outputs = run(llm, prompts)
    assert tokens(outputs) == expected
    assert sum(o.num_cached_tokens for o in outputs) >= 3 * 80
    assert engine(llm).scheduler.get_stats().kv_offload["hits"] >= 2 * 80


def test_offload_with_message_roundtrip(tiny_llama_dir, tmp_path, reference):
    """The blocks cross the runner's message boundary as bytes (as they would to another process)."""
    prompt = ids(4242, 60)
    expected = tokens(run(reference, [prompt]))
    llm = make(tiny_llama_dir, tmp_path)
    llm.llm_engine.core.core.message_roundtrip = True
    run(llm, [prompt])
    engine(llm).kv_tier.flush()
    assert engine(llm).kv_cache.reset_prefix_cache()
    outputs = run(llm, [prompt])
    assert tokens(outputs) == expected and outputs[0].num_cached_tokens == 48


def test_the_level_in_memory_restores_when_the_files_are_gone(tiny_llama_dir, tmp_path, reference):
    """--kv-offload-host-size: the latest blocks are read back from process memory, token-exact, with no file
    left to read; unset, it is 4 GiB on CUDA and none on CPU."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.kv_offload import DEFAULT_CUDA_HOST_BYTES, open_kv_tier

    prompt = ids(4343, 60)
    expected = tokens(run(reference, [prompt]))
    llm = make(tiny_llama_dir, tmp_path, kv_offload_host_size=1 << 20)
    run(llm, [prompt])
    tier = engine(llm).kv_tier
    assert tier.flush() and tier.host_stored_bytes == 4 * tier.payload_bytes  # 70 tokens: 4 full blocks
    for path in tier.root.glob("*/*.kv"):
        path.unlink()
    assert engine(llm).kv_cache.reset_prefix_cache()
    outputs = run(llm, [prompt])
    assert tokens(outputs) == expected and outputs[0].num_cached_tokens == 48
    assert engine(llm).scheduler.get_stats().kv_offload["host_blocks_read"] == 3
    config = EngineConfig(model=str(tiny_llama_dir), kv_offload_dir=str(tmp_path / "defaults"))
    assert open_kv_tier(config, tiny_llama_dir, 1024, "cuda").host_budget_bytes == DEFAULT_CUDA_HOST_BYTES
    assert open_kv_tier(config, tiny_llama_dir, 1024, "cpu").host_budget_bytes == 0


def test_unsupported_combinations_are_refused(tiny_llama_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="extends the prefix cache"):
        make(tiny_llama_dir, tmp_path, enable_prefix_caching=False)


def test_a_pinned_prompt_stays_cached_under_pressure_and_expires(tiny_llama_dir, reference):
    """cache_ttl_s keeps a prompt's blocks through evictions that take every other cached block."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=14, max_model_len=192, numerics="exact")
    pinned, other, big = ids(10, 50), ids(20, 50), ids(5000, 160)
    expected = tokens(run(reference, [pinned, other]))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, cache_ttl_s=600)
    llm.generate([{"prompt_token_ids": pinned}], params, use_tqdm=False)
    run(llm, [other], max_tokens=4)
    assert engine(llm).scheduler.get_stats().num_pinned_blocks == 3
    run(llm, [big], max_tokens=2)  # 11 of the 14 blocks: everything unpinned is evicted
    outputs = run(llm, [pinned, other])
    assert tokens(outputs) == expected
    assert [o.num_cached_tokens for o in outputs] == [48, 0]
    kv = engine(llm).kv_cache
    assert kv.expire_pins(now=float("inf")) == 3 and engine(llm).scheduler.get_stats().num_pinned_blocks == 0


def test_pins_give_way_to_a_request_that_cannot_fit_otherwise(tiny_llama_dir, reference):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=14, max_model_len=224, numerics="exact")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, cache_ttl_s=600)
    llm.generate([{"prompt_token_ids": ids(10, 100)}], params, use_tqdm=False)  # 6 blocks pinned
    assert engine(llm).scheduler.get_stats().num_pinned_blocks == 6
    big = ids(5000, 200)  # 13 blocks: served, not left waiting for the pins to expire
    assert tokens(run(llm, [big], max_tokens=4)) == tokens(run(reference, [big], max_tokens=4))
    assert engine(llm).scheduler.get_stats().num_pinned_blocks < 6


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_sliding_window_models_restore_every_group(tmp_path_factory, smollm2_tokenizer, family):
    """Gemma 3 (local and global layer groups) and Mistral (every layer windowed, window 12): a restored
    prefix brings back each group's blocks its window still reads, and the outputs match computing it."""
    from model_factory import build_tiny_family

    directory = build_tiny_family(tmp_path_factory.mktemp(f"tier-{family}"), smollm2_tokenizer, family)
    tier_dir = tmp_path_factory.mktemp(f"tier-{family}-blocks")
    prompts = [ids(11, 90), ids(11, 70) + ids(600, 25)]
    settings = dict(num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=256, numerics="exact")
    expected = tokens(run(LLM(str(directory), enable_prefix_caching=False, **settings), prompts))
    first = LLM(str(directory), kv_offload_dir=str(tier_dir), **settings)
    assert tokens(run(first, prompts[:1])) == expected[:1]
    first.shutdown()
    restarted = LLM(str(directory), kv_offload_dir=str(tier_dir), **settings)
    outputs = run(restarted, prompts)
    assert tokens(outputs) == expected
    assert [o.num_cached_tokens for o in outputs] == [80, 64]
    stats = engine(restarted).scheduler.get_stats()
    # The second prompt's window blocks past the shared prefix's memory copy come from the tier as well.
    assert stats.kv_offload["hits"] >= 80 and stats.kv_offload["blocks_read"] > 0 and stats.kv_offload["corrupt"] == 0


def test_a_cache_dtype_of_the_same_size_never_reads_the_others_blocks(tiny_llama_dir, tmp_path):
    """bfloat16 and float16 blocks have the same bytes per block: only the fingerprint tells them apart."""
    prompt = ids(515, 70)
    for kv_cache_dtype, cached in (("bfloat16", 0), ("float16", 0), ("bfloat16", 64)):
        llm = make(tiny_llama_dir, tmp_path, numerics="auto", dtype="float32", kv_cache_dtype=kv_cache_dtype)
        assert run(llm, [prompt])[0].num_cached_tokens == cached, kv_cache_dtype
        llm.shutdown()


def test_an_int8_cache_restores_its_blocks_from_the_tier(request, tiny_llama_dir, tmp_path):
    """--kv-cache-dtype int8: the tier stores a block's int8 values and scales as bytes and restores them, so a
    prefix read back from the tier gives the tokens computing it gave."""
    request.getfixturevalue("kernels")
    numerics = dict(numerics="auto", kv_cache_dtype="int8", dtype="float32", block_matmul="float32")
    prompts = [ids(5, 100), ids(5, 70) + ids(900, 20)]
    plain = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=512, enable_prefix_caching=False, **numerics)
    expected = tokens(run(plain, prompts))
    llm = make(tiny_llama_dir, tmp_path, **numerics)
    core = engine(llm)
    assert core.runner.kv_caches[0].dtype == torch.int8
    assert tokens(run(llm, prompts[:1])) == expected[:1]
    assert core.kv_tier.flush()
    assert core.kv_cache.reset_prefix_cache()
    outputs = run(llm, prompts)
    assert tokens(outputs) == expected
    assert core.scheduler.get_stats().kv_offload["hits"] == 96
