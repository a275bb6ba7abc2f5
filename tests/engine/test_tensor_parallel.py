"""--tensor-parallel-size: the model split over worker processes gives the same greedy tokens, refuses
models whose heads do not split, and leaves no worker behind."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from model_factory import GOLDEN_PROMPTS, build_tiny_family, write_family_gguf
from proc_util import is_alive, still_alive
from tokenmill.config import EngineConfig
from tokenmill.distributed.parallel_state import TensorParallelGroup
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import EngineDeadError, EngineFailedError, ModelLoadError
from tokenmill.model.layers.linear import Int8Blocks, quantize_q8_0
from tokenmill.model.layers.parallel import int8_columns, int8_rows, shard_int8_blocks, shard_tensor
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = GOLDEN_PROMPTS[:4]


def _greedy(model: str, tp: int, **kwargs) -> list[list[int]]:
    # A small step budget: Gemma 3's five windowed KV groups then need only a few of the 64 blocks each.
    # The exact numerics unless the test names its own: one rank's and N ranks' sums then round alike.
    kwargs = kwargs if "block_matmul" in kwargs else {"numerics": "exact", **kwargs}
    llm = LLM(model, tensor_parallel_size=tp, max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=32,
              **kwargs)
    try:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


# ---- slicing weights (no processes) --------------------------------------------------------------
def test_int8_blocks_slice_like_their_dequantized_weights():
    weight = torch.randn(6, 128)
    blocks = Int8Blocks(*quantize_q8_0(weight), mins=torch.randn(6, 4))
    dense = blocks.dequantize()
    assert torch.equal(int8_rows(blocks, 2, 4).dequantize(), dense[2:4])
    assert torch.equal(int8_columns(blocks, 64, 128).dequantize(), dense[:, 64:128])
    padded = int8_rows(blocks, 4, 8).dequantize()  # past the last row: zeros (a padded vocabulary)
    assert torch.equal(padded[:2], dense[4:6]) and not padded[2:].any()
    with pytest.raises(ValueError, match="32-value blocks"):
        int8_columns(blocks, 16, 80)


def test_shards_of_each_kind_of_tensor():
    rank1 = TensorParallelGroup(rank=1, size=2)
    w = torch.arange(24.0).reshape(6, 4)
    assert torch.equal(shard_tensor("model.layers.0.self_attn.k_proj.weight", w, rank1), w[3:])
    assert torch.equal(shard_tensor("model.layers.0.mlp.down_proj.weight", w, rank1), w[:, 2:])
    assert not shard_tensor("model.layers.0.self_attn.o_proj.bias", w[0], rank1).any()  # added once, by rank 0
    assert torch.equal(shard_tensor("model.layers.0.input_layernorm.weight", w[0], rank1), w[0])
    vocab = shard_tensor("model.embed_tokens.weight", w[:5], rank1)  # 5 rows: 3 per rank, one zero row
    assert torch.equal(vocab[:2], w[3:5]) and not vocab[2].any()


def test_fused_checkpoint_tensors_split_part_by_part():
    # Phi-3's qkv_proj (q 4 rows, k 2, v 2) and gate_up_proj (gate 4, up 4): rank 1 of 2 holds the
    # second half of each part, joined in the parts' order.
    rank1 = TensorParallelGroup(rank=1, size=2)
    qkv = torch.arange(8.0).unsqueeze(1).expand(8, 3)
    got = shard_tensor("model.layers.0.self_attn.qkv_proj.weight", qkv, rank1, qkv_rows=(4, 2, 2))
    assert got[:, 0].tolist() == [2, 3, 5, 7]
    gate_up = torch.arange(8.0).unsqueeze(1)
    assert shard_tensor("model.layers.0.mlp.gate_up_proj.weight", gate_up, rank1)[:, 0].tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="q/k/v sizes"):
        shard_tensor("model.layers.0.self_attn.qkv_proj.weight", qkv, rank1)


def test_stacked_experts_split_by_their_features():
    # [experts, rows, cols]: gate_up rows (gate half, up half) and down_proj's input columns.
    rank0 = TensorParallelGroup(rank=0, size=2)
    gate_up = torch.arange(2 * 8 * 3.0).reshape(2, 8, 3)
    got = shard_tensor("model.layers.0.mlp.experts.gate_up_proj", gate_up, rank0)
    assert torch.equal(got, torch.cat([gate_up[:, 0:2], gate_up[:, 4:6]], dim=1))
    down = torch.arange(2 * 3 * 4.0).reshape(2, 3, 4)
    assert torch.equal(shard_tensor("model.layers.0.mlp.experts.down_proj", down, rank0), down[:, :, :2])
    gate = torch.arange(2 * 4 * 3.0).reshape(2, 4, 3)
    assert torch.equal(shard_tensor("model.layers.0.mlp.experts.gate_proj", gate, rank0), gate[:, :2])
    # A GGUF's stacked experts carry the .weight suffix.
    assert torch.equal(shard_tensor("model.layers.0.mlp.experts.up_proj.weight", gate, rank0), gate[:, :2])
    assert torch.equal(shard_tensor("model.layers.0.mlp.experts.down_proj.weight", down, rank0), down[:, :, :2])
    # One expert's own matrices are ordinary column- and row-parallel ones; the router is replicated.
    assert torch.equal(shard_tensor("model.layers.0.mlp.experts.3.up_proj.weight", gate[0], rank0), gate[0, :2])
    assert torch.equal(shard_tensor("model.layers.0.mlp.gate.weight", gate[0], rank0), gate[0])


def test_fused_int8_blocks_slice_like_their_dequantized_weights():
    qkv = Int8Blocks(*quantize_q8_0(torch.randn(16, 64)), mins=torch.randn(16, 2))
    gate_up = Int8Blocks(*quantize_q8_0(torch.randn(8, 64)))
    for rank in range(2):
        tp = TensorParallelGroup(rank=rank, size=2)
        kept = {"model.layers.0.self_attn.qkv_proj.weight": qkv, "model.layers.0.mlp.gate_up_proj.weight": gate_up}
        shard_int8_blocks(kept, tp, qkv_rows=(8, 4, 4))
        for name, blocks in (("model.layers.0.self_attn.qkv_proj.weight", qkv),
                             ("model.layers.0.mlp.gate_up_proj.weight", gate_up)):
            want = shard_tensor(name, blocks.dequantize(), tp, qkv_rows=(8, 4, 4))
            assert torch.equal(kept[name].dequantize(), want), (name, rank)


def test_a_row_parallel_int8_shard_off_the_block_grid_stays_dense():
    blocks = Int8Blocks(*quantize_q8_0(torch.randn(8, 64)))
    kept = {"model.layers.0.mlp.down_proj.weight": blocks, "model.layers.0.mlp.up_proj.weight": blocks}
    shard_int8_blocks(kept, TensorParallelGroup(rank=0, size=4))  # 16 inputs per rank: not a whole block
    assert (list(kept) == ["model.layers.0.mlp.up_proj.weight"]
            and kept["model.layers.0.mlp.up_proj.weight"].q.shape == (2, 64))


# ---- errors ---------------------------------------------------------------------------------------
def test_heads_that_do_not_split_are_refused_before_any_worker_starts(smollm2_path):
    # SmolLM2-135M: 9 attention heads, 3 KV heads.
    with pytest.raises(ModelLoadError,
                       match=r"^num_key_value_heads \(3\) is not divisible by --tensor-parallel-size 2$"):
        LLM(str(smollm2_path), tensor_parallel_size=2, numerics="exact")


def test_tensor_parallel_size_must_be_positive():
    with pytest.raises(ValueError, match="tensor_parallel_size must be positive"):
        EngineConfig(tensor_parallel_size=0)


# ---- parity with one process ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe",
                                    "mixtral"])
def test_two_ranks_match_one_on_every_family(family, tmp_path, smollm2_tokenizer, tiny_llama_dir):
    model = tiny_llama_dir if family == "llama" else build_tiny_family(tmp_path, smollm2_tokenizer, family)
    assert _greedy(str(model), 2) == _greedy(str(model), 1)


@pytest.mark.slow
@pytest.mark.parametrize("block_matmul", ["float32", "int8"])
def test_two_ranks_match_one_with_kept_gguf_int8_blocks(tiny_gguf_path, tiny_llama_dir, block_matmul):
    # Row-parallel o_proj/down_proj keep their int8 blocks (32 and 64 inputs per rank); the fused C++
    # decode stack is off under tensor parallelism. Under --block-matmul int8 each rank keeps its shards in
    # the dot products' layout and rounds its slice of x per block of 32, as one process does.
    kwargs = dict(tokenizer=str(tiny_llama_dir), block_matmul=block_matmul, dtype="float32", kv_cache_dtype="float32")
    assert _greedy(str(tiny_gguf_path), 2, **kwargs) == _greedy(str(tiny_gguf_path), 1, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["phi3", "qwen3moe"])
def test_two_ranks_match_one_on_family_ggufs(family, tmp_path, smollm2_tokenizer):
    # Phi-3's GGUF keeps qkv_proj and gate_up_proj fused: each rank's int8 blocks are its rows of every
    # part. Qwen3-MoE's GGUF stacks each layer's experts in one [experts, out, in] tensor per projection.
    directory = build_tiny_family(tmp_path / family, smollm2_tokenizer, family)
    path = tmp_path / f"{family}.gguf"
    write_family_gguf(path, directory, family)
    kwargs = dict(tokenizer=str(directory))
    assert _greedy(str(path), 2, **kwargs) == _greedy(str(path), 1, **kwargs)


@pytest.mark.slow
def test_three_ranks_match_one_on_the_embedded_smollm2(smollm2_path):
    # SmolLM2-135M's 9 heads and 3 KV heads split three ways (not two); its Q8_0 blocks stay int8.
    assert _greedy(str(smollm2_path), 3) == _greedy(str(smollm2_path), 1)


# ---- worker lifetime --------------------------------------------------------------------------------
@pytest.mark.slow
def test_shutdown_leaves_no_worker_and_a_dead_worker_fails_the_step(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, max_model_len=256, num_kv_blocks=64, numerics="exact")
    executor = llm.llm_engine.core.core.executor
    pids = [worker.pid for worker in executor.workers]
    assert len(pids) == 2 and all(is_alive(pid) for pid in pids)
    llm.generate(["Hi"], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert not any(is_alive(pid) for pid in pids)

    # Started from a thread that then ends: the workers live on (they follow the process, not the thread).
    holder: dict = {}
    starter = threading.Thread(target=lambda: holder.update(llm=LLM(str(tiny_llama_dir), tensor_parallel_size=2,
                                                                    max_model_len=256, num_kv_blocks=64,
                                                                    numerics="exact")))
    starter.start()
    starter.join()
    llm = holder["llm"]
    assert llm.generate(["Hi"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    pids = [worker.pid for worker in llm.llm_engine.core.core.executor.workers]
    os.kill(pids[1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises((EngineDeadError, EngineFailedError), match="tensor-parallel worker"):
        llm.generate(["Hi"], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 30
    llm.shutdown()
    assert still_alive(pids, 10) == []


def test_worker_messages_hold_plain_data():
    import msgspec

    from tokenmill.core.sched_output import ScheduledRequest, SchedulerOutput, WorkerInput, WorkerStep
    from tokenmill.engine.messages import encode

    step = WorkerStep(SchedulerOutput(scheduled=[ScheduledRequest("r", 0, 2, [1, 2], [0], samples=True)]))
    assert msgspec.msgpack.decode(encode(step), type=WorkerInput) == step


@pytest.mark.slow
def test_data_parallel_cores_each_run_their_own_tensor_parallel_workers(tiny_llama_dir):
    import asyncio

    from proc_util import child_pids, descendants, thread_niceness
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.sampling_params import RequestOutputKind

    expected = _greedy(str(tiny_llama_dir), 1)
    engine = AsyncLLM.from_config(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256,
                                               data_parallel_size=2, tensor_parallel_size=2, numerics="exact"))
    params = GREEDY.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    # Each core's workers fork from its forkserver: the core's grandchildren.
    workers = [pid for client in engine.clients for child in child_pids(client.process.pid)
               for pid in child_pids(child)]
    assert len(workers) == 4  # two per core
    below = [pid for client in engine.clients for pid in descendants(client.process.pid)]
    # The workers inherit their core's niceness (10 on CPU) from the thread that starts them.
    niced = {min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)}
    assert all(thread_niceness(pid) == niced for pid in [client.process.pid for client in engine.clients] + workers)

    async def run() -> list[list[int]]:
        async def one(i: int, prompt: str) -> list[int]:
            async for out in engine.generate(engine.input_processor.process_prompt(prompt), params, f"r{i}"):
                final = out
            return final.outputs[0].token_ids

        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == expected
    assert still_alive(below, 10) == []  # the workers, and each core's forkserver and resource tracker


def test_kv_offload_tier_under_two_ranks(tmp_path, tiny_llama_dir):
    """Each stored block holds both ranks' shards (gathered to the driver); a restarted engine restores
    them, each rank taking its own, with the tokens one rank computes. A one-rank engine's blocks in the
    same directory are never read by two ranks (another fingerprint), nor theirs by it."""
    prompt = {"prompt_token_ids": [(11 + 37 * i) % 40000 + 100 for i in range(200)]}
    settings = dict(max_model_len=512, num_kv_blocks=64, numerics="exact", kv_offload_dir=str(tmp_path))
    single = LLM(str(tiny_llama_dir), **settings)
    first = single.generate([prompt], GREEDY, use_tqdm=False)[0]
    single.shutdown()
    assert first.num_cached_tokens == 0
    for attempt in range(2):
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **settings)
        try:
            out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == first.outputs[0].token_ids
            assert out.num_cached_tokens == (192 if attempt else 0)
            core = llm.llm_engine.core.core
            assert core.kv_tier.payload_bytes == 2 * core.bytes_per_block
        finally:
            llm.shutdown()


def test_two_ranks_with_a_draft_model_match_one_without(request, tiny_llama_dir):
    """The draft model runs on the rank that samples (whole, not sharded): the tokens are still the target's."""
    request.getfixturevalue("kernels")
    drafted = _greedy(str(tiny_llama_dir), 2, speculative_config={"model": str(tiny_llama_dir),
                                                                  "num_speculative_tokens": 3})
    assert drafted == _greedy(str(tiny_llama_dir), 1)


@pytest.mark.slow
def test_a_script_without_a_main_guard_gets_a_clear_error(tmp_path, tiny_llama_dir):
    """Workers fork from a forkserver whose children import the starting script's main module: a script that
    builds the engine at its top level (no `if __name__ == "__main__":`) cannot start its workers, and says so."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("import sys\nfrom tokenmill import LLM\n"
                      "LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=64, num_kv_blocks=8, numerics='exact')\n")
    run = subprocess.run([sys.executable, str(script), str(tiny_llama_dir)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert "EngineDeadError: tensor-parallel worker" in run.stderr and "__main__" in run.stderr.splitlines()[-1]
