"""--data-parallel-size: N engine cores behind one AsyncLLM, and the prefix-aware router between them."""
from __future__ import annotations

import asyncio

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.dp_router import DataParallelRouter
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


def _prefix(i: int, length: int = 64) -> list[int]:
    return [1000 + 97 * i + t for t in range(length)]


def test_router_prefers_the_core_holding_the_prefix_unless_it_is_much_busier():
    router = DataParallelRouter(2, block_size=4, capacity_blocks=100, max_imbalance=1)
    a, b = list(range(16)), list(range(100, 116))
    assert router.choose(a) == 0 and router.choose(b) == 1  # new prefixes spread
    assert router.choose(a + [7, 7]) == 0 and router.choose(b + [9]) == 1  # prefix hits
    assert router.choose(a) == 0 and router.choose(a) == 0  # 2 vs 2, then 3 vs 2 in flight: within the margin
    assert router.choose(a) == 1  # 4 vs 2 exceeds it: the least-loaded core instead
    assert [e["routed_by_prefix"] for e in router.stats()] == [3, 1]
    assert [e["in_flight"] for e in router.stats()] == [4, 3]
    for _ in range(3):
        router.finished(0)
    assert router.engines[0].in_flight == 1


def test_a_prefix_in_the_shared_tier_draws_no_request_to_one_core(tmp_path):
    """Every core restores a prefix the shared KV offload tier holds, so only a longer in-memory prefix
    earns a core the request; the rest goes by load."""
    from tokenmill.core.kv_tier import TierView, block_path
    from tokenmill.engine.dp_router import prompt_block_hashes

    tier = TierView(str(tmp_path), file_bytes=8)
    router = DataParallelRouter(2, block_size=4, capacity_blocks=100, shared_tier=tier)
    a = list(range(16))
    assert router.choose(a) == 0
    assert router.choose(a) == 0  # core 0 holds the prefix in memory; the tier holds none of it
    for key in prompt_block_hashes(a, 4)[:3]:  # the tier holds 3 of its 4 blocks...
        block_path(tmp_path, key).parent.mkdir(exist_ok=True)
        block_path(tmp_path, key).write_bytes(b"12345678")
    assert router.choose(a) == 0  # ...core 0 still holds one block more
    for key in prompt_block_hashes(a, 4):
        block_path(tmp_path, key).parent.mkdir(exist_ok=True)
        block_path(tmp_path, key).write_bytes(b"12345678")
    assert router.choose(a) == 1  # all of it: the least-loaded core
    assert [e["routed_with_tier_prefix"] for e in router.stats()] == [1, 1]
    assert [e["routed_by_prefix"] for e in router.stats()] == [2, 0]


@pytest.mark.parametrize("policy", ["prefix", "round_robin"])
def test_long_prompts_have_a_lane_of_their_own(policy):
    router = DataParallelRouter(3, block_size=4, capacity_blocks=100, policy=policy, long_prompt_threshold=50)
    long_prompt, short_prompts = list(range(200)), [[1000 + i] * 10 for i in range(6)]
    # Short prompts never go to the last core, even while it is idle.
    short_cores = [router.choose(p, key=f"s{i}") for i, p in enumerate(short_prompts)]
    assert sorted(short_cores) == [0, 0, 0, 1, 1, 1]
    assert router.choose(list(range(50))) in (0, 1)  # at the threshold: short
    # A long prompt goes to the last core; while it carries one, the next borrows a short-lane core
    # carrying no long prompt (each at most one), and once every core carries one the rest queue in the lane.
    assert router.choose(long_prompt, key="l0") == 2
    borrowed = [router.choose(long_prompt, key=f"l{i}") for i in (1, 2)]
    assert sorted(borrowed) == [0, 1]
    assert [router.choose(long_prompt, key=f"l{i}") for i in (3, 4)] == [2, 2]
    assert [e.long_in_flight for e in router.engines] == [1, 1, 3]
    # A borrowed core that finished its long prompt may take the next one.
    router.finished(borrowed[0], key="l1")
    assert router.choose(long_prompt, key="l5") == borrowed[0]
    router.finished(short_cores[0], key="s0")  # a short request finishing changes no long count
    assert [e.long_in_flight for e in router.engines] == [1, 1, 3]
    single = DataParallelRouter(1, block_size=4, capacity_blocks=100, long_prompt_threshold=50)
    assert single.choose(long_prompt) == 0 and single.choose([1] * 10) == 0  # one core: no lanes
    # Without borrowing, every long prompt stays on its lane however busy it is.
    strict = DataParallelRouter(3, block_size=4, capacity_blocks=100, policy=policy, long_prompt_threshold=50,
                                long_prompt_borrowing=False)
    assert [strict.choose(long_prompt, key=f"l{i}") for i in range(4)] == [2, 2, 2, 2]
    assert {strict.choose(p, key=f"s{i}") for i, p in enumerate(short_prompts)} == {0, 1}


def test_round_robin_ignores_prefixes():
    router = DataParallelRouter(2, block_size=4, capacity_blocks=100, policy="round_robin")
    assert [router.choose(list(range(16))) for _ in range(4)] == [0, 1, 0, 1]


async def _serve(engine: AsyncLLM, prompts: list[list[int]], concurrent: bool, tag: str = "") -> None:
    async def one(i: int, prompt: list[int]) -> None:
        async for _ in engine.generate(ProcessedPrompt(None, prompt), PARAMS, f"r{tag}{i}"):
            pass

    if concurrent:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    else:
        for i, p in enumerate(prompts):
            await one(i, p)


def _hit_rate(engine: AsyncLLM) -> float:
    replicas = engine.get_stats()["data_parallel"]
    return sum(r["prefix_cache_hits"] for r in replicas) / sum(r["prefix_cache_queries"] for r in replicas)


@pytest.mark.slow
def test_requests_sharing_a_prefix_land_on_the_core_that_holds_it(tiny_llama_dir):
    engine = AsyncLLM.from_config(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256,
                                               data_parallel_size=2, numerics="exact"))
    async def run() -> list[dict]:
        try:
            a, b = _prefix(0), _prefix(1)
            await _serve(engine, [a + [5], b + [5]], concurrent=False, tag="w")  # one core each
            await _serve(engine, [p + [10 + i] for i in range(3) for p in (a, b)], concurrent=True)
            return engine.get_stats()["data_parallel"]
        finally:
            await engine.shutdown()

    assert len(engine.clients) == 2 and engine.clients[0].process.pid != engine.clients[1].process.pid
    replicas = asyncio.run(run())
    assert [r["routed"] for r in replicas] == [4, 4]
    assert [r["routed_by_prefix"] for r in replicas] == [3, 3]
    # Every follower hit its prefix (4 full blocks of 16) on the core that computed it.
    assert all(r["prefix_cache_hits"] >= 3 * 64 for r in replicas)
    assert not any(c.process.is_alive() for c in engine.clients)


@pytest.mark.slow
def test_prefix_routing_at_least_doubles_the_hit_rate_of_round_robin(tiny_llama_dir):
    """Nine system prompts taken in turn by four rounds of users; each core's cache holds about five
    prefixes: routed, each core keeps its share; round robin makes both cycle through all nine."""
    prompts = [_prefix(i) + [7, 8, 9, 10 + rnd] for rnd in range(4) for i in range(9)]
    rates = {}
    for policy in ("prefix", "round_robin"):
        engine = AsyncLLM.from_config(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=26, max_model_len=256,
                                                   data_parallel_size=2, data_parallel_routing=policy,
                                                   numerics="exact"))
        async def run() -> float:
            try:
                await _serve(engine, prompts, concurrent=False)
                return _hit_rate(engine)
            finally:
                await engine.shutdown()

        rates[policy] = asyncio.run(run())
    assert rates["prefix"] > 0.5 and rates["prefix"] >= 2 * rates["round_robin"], rates


def test_prefix_affinity_keys_replicas_by_name_and_forgets_departed_ones():
    from tokenmill.engine.dp_router import PrefixAffinity

    affinity: PrefixAffinity[str] = PrefixAffinity(block_size=4, capacity_blocks=3, max_imbalance=2)
    hashes = affinity.block_hashes(list(range(18)))
    assert len(hashes) == 4  # full blocks only
    assert affinity.choose(hashes, {"a": 0, "b": 0}) == ("a", False)  # nothing cached: least loaded, first
    affinity.remember("b", hashes)
    assert affinity.matched_blocks("b", hashes) == 0  # capacity 3 kept the last three: the chain's head is gone
    affinity.remember("b", hashes[:2])
    assert affinity.matched_blocks("b", hashes) == 2
    assert affinity.choose(hashes, {"a": 0, "b": 2}) == ("b", True)
    assert affinity.choose(hashes, {"a": 0, "b": 3}) == ("a", False)  # busier by more than the margin
    assert affinity.choose(hashes, {"c": 1, "b": 1}) == ("b", True)  # a replica unseen so far
    affinity.forget("b")
    assert affinity.choose(hashes, {"c": 1, "b": 0}) == ("b", False)
