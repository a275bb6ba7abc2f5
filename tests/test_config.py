"""EngineConfig is the one source of every engine option: the CLI, LLM(**kwargs) and validation all
come from its fields."""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from tokenmill.config import (
    ATTENTION_BACKENDS,
    BLOCK_MATMULS,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    EngineConfig,
    engine_options,
    usable_cpu_count,
)
from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tokenmill.errors import InvalidRequestError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def parse(*argv: str) -> EngineConfig:
    parser = _Parser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def parse_error(*argv: str) -> str:
    with pytest.raises(ValueError) as info:
        parse(*argv)
    return str(info.value)


def engine_actions() -> dict[str, argparse.Action]:
    parser = _Parser()
    add_engine_args(parser)
    return {action.dest: action for action in parser._actions if action.dest != "help"}


# ---- every field has a flag ----------------------------------------------------------------------------
def test_every_field_has_a_flag_with_help():
    actions = engine_actions()
    assert set(actions) == {f.name for f in engine_options()}
    for f in engine_options():
        action = actions[f.name]
        assert "--" + f.name.replace("_", "-") in action.option_strings
        assert action.help and action.help == f.metadata["help"]
        assert action.default == f.default


def test_choices_come_from_the_module_constants():
    actions = engine_actions()
    assert actions["dtype"].choices is DTYPES
    assert actions["device"].choices is DEVICES
    assert actions["scheduling_policy"].choices is SCHEDULING_POLICIES
    assert actions["attention_backend"].choices is ATTENTION_BACKENDS
    assert actions["quantization"].choices is QUANTIZATIONS
    assert actions["block_matmul"].choices is BLOCK_MATMULS
    assert actions["kv_cache_dtype"].choices is KV_CACHE_DTYPES
    assert actions["preemption_mode"].choices is PREEMPTION_MODES


def test_bools_take_a_no_form():
    actions = engine_actions()
    for name in ("enable_chunked_prefill", "enable_prefix_caching", "packed_linear", "structured_outputs_fast_forward"):
        assert "--no-" + name.replace("_", "-") in actions[name].option_strings


# ---- the flags parse to what they did before ----------------------------------------------------------------
def test_no_flags_give_the_defaults():
    assert parse() == EngineConfig()
    assert dataclasses.asdict(parse()) == {
        "model": None, "served_model_name": None, "tokenizer": None, "dtype": "auto", "device": None,
        "max_model_len": None, "block_size": 16, "max_num_seqs": 64, "max_num_batched_tokens": None,
        "kv_cache_memory_bytes": None, "gpu_memory_utilization": 0.9, "num_kv_blocks": None,
        "enable_chunked_prefill": True, "enable_prefix_caching": True, "scheduling_policy": "fcfs",
        "lpm_max_wait": 5.0, "max_preemptions": 4, "max_num_queued_requests": None, "max_queue_time": None,
        "max_prompt_tokens": None, "max_mixed_prefill_tokens": None, "long_prefill_token_threshold": None,
        "max_long_partial_prefills": 1, "swap_space": 0.0, "kv_offload_dir": None,
        "kv_offload_size": 8 * 1024**3, "kv_offload_host_size": None, "kv_cache_pin_fraction": 0.5,
        "preemption_mode": None, "seed": 0, "max_logprobs": 20, "num_threads": None,
        "attention_backend": "auto", "packed_linear": True, "quantization": None, "block_matmul": "auto",
        "kv_cache_dtype": "auto", "numerics": "auto",
        "structured_outputs_fast_forward": True, "data_parallel_size": 1, "data_parallel_routing": "prefix",
        "data_parallel_long_prompt_threshold": None, "data_parallel_long_prompt_borrowing": True,
        "tensor_parallel_size": 1, "engine_core_nice": None, "speculative_config": None,
        "enable_lora": False, "max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": None}


def test_every_old_flag_parses_to_the_same_value():
    from tokenmill.spec_decode.ngram import SpeculativeConfig

    config = parse(
        "--model", "m", "--tokenizer", "t", "--served-model-name", "s", "--dtype", "bfloat16", "--device", "cpu",
        "--max-model-len", "512", "--block-size", "32", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
        "--kv-cache-memory-bytes", "4GiB", "--gpu-memory-utilization", "0.5", "--num-kv-blocks", "100",
        "--no-enable-chunked-prefill", "--no-enable-prefix-caching", "--scheduling-policy", "lpm",
        "--lpm-max-wait", "0.5", "--max-preemptions", "2", "--max-num-queued-requests", "10",
        "--max-queue-time", "3.5", "--max-prompt-tokens", "100", "--max-mixed-prefill-tokens", "128",
        "--long-prefill-token-threshold", "64",
        "--max-long-partial-prefills", "2", "--swap-space", "1.5", "--preemption-mode", "swap", "--seed", "7",
        "--num-threads", "2", "--attention-backend", "torch", "--no-packed-linear", "-q", "q8_0",
        "--kv-cache-dtype", "float16", "--no-structured-outputs-fast-forward", "--engine-core-nice", "5",
        "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 2}))
    assert config == EngineConfig(
        model="m", tokenizer="t", served_model_name="s", dtype="bfloat16", device="cpu", max_model_len=512,
        block_size=32, max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory_bytes=4 * 1024**3,
        gpu_memory_utilization=0.5, num_kv_blocks=100, enable_chunked_prefill=False, enable_prefix_caching=False,
        scheduling_policy="lpm", lpm_max_wait=0.5, max_preemptions=2, max_num_queued_requests=10,
        max_queue_time=3.5, max_prompt_tokens=100, max_mixed_prefill_tokens=128, long_prefill_token_threshold=64,
        max_long_partial_prefills=2, swap_space=1.5, preemption_mode="swap", seed=7, num_threads=2,
        attention_backend="torch",
        packed_linear=False, quantization="q8_0", kv_cache_dtype="float16", structured_outputs_fast_forward=False,
        engine_core_nice=5,
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=4))
    assert config.kv_cache_memory_bytes == 4294967296


def test_special_values_and_aliases():
    assert parse("--kv-cache-memory-bytes", "512MB").kv_cache_memory_bytes == 512_000_000
    assert parse("--kv-cache-memory-bytes", "1073741824").kv_cache_memory_bytes == 1073741824
    assert parse("--quantization", "gguf").quantization == "gguf"
    assert parse("-q", "none").quantization == "none"
    assert parse("--kv-cache-dtype", "fp16").kv_cache_dtype == "float16"
    assert parse("--kv-cache-dtype", "bf16").kv_cache_dtype == "bfloat16"
    assert parse("--kv-cache-dtype", "q8_0").kv_cache_dtype == "int8"
    assert parse("--enable-prefix-caching", "--packed-linear").enable_prefix_caching is True
    assert parse("--seed", "-1").seed == -1
    assert parse("--max-logprobs", "5").max_logprobs == 5
    assert parse("--gpu-memory-utilization", "1").gpu_memory_utilization == 1.0


def test_a_parser_without_some_engine_flags_leaves_their_defaults():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-num-seqs", type=int, default=3)
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig(max_num_seqs=3)


# ---- bad values: one clear message ---------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (("--dtype", "fp64"), "argument --dtype: invalid choice: 'fp64'"),
    (("--scheduling-policy", "lifo"), "argument --scheduling-policy: invalid choice: 'lifo'"),
    (("-q", "int4"), "argument --quantization/-q: invalid choice: 'int4'"),
    (("--kv-cache-dtype", "fp8"), "argument --kv-cache-dtype: invalid choice: 'fp8'"),
    (("--preemption-mode", "drop"), "argument --preemption-mode: invalid choice: 'drop'"),
    (("--attention-backend", "flash"), "argument --attention-backend: invalid choice: 'flash'"),
    (("--max-num-seqs", "0"), "argument --max-num-seqs: expected a positive integer, got '0'"),
    (("--block-size", "x"), "argument --block-size: expected a positive integer, got 'x'"),
    (("--lpm-max-wait", "0"), "argument --lpm-max-wait: expected a positive number, got '0'"),
    (("--swap-space", "-1"), "argument --swap-space: expected a non-negative number, got '-1'"),
    (("--gpu-memory-utilization", "1.5"), "argument --gpu-memory-utilization: expected a number in (0, 1], got '1.5'"),
    (("--kv-cache-memory-bytes", "lots"), "argument --kv-cache-memory-bytes: cannot read memory size 'lots'"),
    (("--speculative-config", "[1]"), "argument --speculative-config: expected a JSON object, got '[1]'"),
    (("--engine-core-nice", "20"), "argument --engine-core-nice: expected an integer between 0 and 19, got '20'"),
])
def test_bad_flags_are_argparse_errors(argv, message):
    assert parse_error(*argv).startswith(message)


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "fp64"}, "dtype must be one of auto, float32, bfloat16, float16, got 'fp64'"),
    ({"quantization": "int4"}, "quantization must be one of gguf, q8_0, none (or unset), got 'int4'"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of fcfs, priority, fair, lpm, got 'lifo'"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, float32, float16, bfloat16, int8, got 'fp8'"),
    ({"max_num_seqs": 0}, "max_num_seqs must be positive, got 0"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
    ({"swap_space": -1}, "swap_space must be non-negative, got -1"),
    ({"engine_core_nice": -5}, "engine_core_nice must be between 0 and 19, got -5"),
    ({"kv_cache_memory_bytes": "lots"}, "cannot read memory size 'lots'"),
    ({"kv_cache_dtype": "float16", "numerics": "exact"},
     "--numerics exact computes in float32 throughout; it cannot be combined with --kv-cache-dtype float16"),
    ({"dtype": "bfloat16", "numerics": "exact"}, "--numerics exact computes in float32 throughout"),
])
def test_bad_values_are_refused_by_the_config(kwargs, message):
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(**kwargs)
    assert info.value.message.startswith(message)
    if "kv_cache_memory_bytes" not in kwargs:
        assert info.value.param == next(iter(kwargs))


# ---- LLM(**kwargs) ---------------------------------------------------------------------------------
def test_unknown_keyword_names_the_nearest_field():
    with pytest.raises(InvalidRequestError, match=r"unknown engine option 'max_num_seq'; did you mean 'max_num_seqs'"):
        EngineConfig.from_kwargs(max_num_seq=8)
    with pytest.raises(InvalidRequestError, match=r"'enable_prefix_cache'; did you mean 'enable_prefix_caching'"):
        EngineConfig.from_kwargs(enable_prefix_cache=False)
    with pytest.raises(InvalidRequestError, match=r"^unknown engine option 'zzz'$"):
        EngineConfig.from_kwargs(zzz=1)
    assert EngineConfig.from_kwargs(max_num_seqs=8) == EngineConfig(max_num_seqs=8)


def test_llm_refuses_a_typo_before_loading_anything():
    from tokenmill import LLM

    with pytest.raises(InvalidRequestError, match="did you mean 'kv_cache_memory_bytes'") as info:
        LLM(kv_cache_memory_byte="1GiB")
    assert info.value.param == "kv_cache_memory_byte"


# ---- nothing rewrites a validated config -------------------------------------------------------------
def test_validation_keeps_every_value_as_given():
    values = dict(model="m", served_model_name="s", tokenizer="t", dtype="auto", device="cuda", max_model_len=100,
                  block_size=8, max_num_seqs=3, max_num_batched_tokens=None, kv_cache_memory_bytes=123456,
                  gpu_memory_utilization=0.7, num_kv_blocks=9, enable_chunked_prefill=False,
                  enable_prefix_caching=False, scheduling_policy="fair", lpm_max_wait=2.0, max_preemptions=None,
                  max_num_queued_requests=5, max_queue_time=1.5, max_prompt_tokens=50, max_mixed_prefill_tokens=64,
                  long_prefill_token_threshold=20, max_long_partial_prefills=2, swap_space=0.5,
                  kv_offload_dir="/tmp/tier", kv_offload_size=2**30, kv_offload_host_size=2**29,
                  kv_cache_pin_fraction=0.25, preemption_mode=None, seed=3, max_logprobs=0, num_threads=1,
                  attention_backend="cpu",
                  packed_linear=False, quantization="q8_0", block_matmul="int8", kv_cache_dtype="bfloat16",
                  structured_outputs_fast_forward=False, data_parallel_size=2, data_parallel_routing="round_robin",
                  data_parallel_long_prompt_threshold=512, data_parallel_long_prompt_borrowing=False,
                  tensor_parallel_size=2, engine_core_nice=0, speculative_config=None, numerics="auto",
                  enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=5)
    assert set(values) == {f.name for f in engine_options()}
    config = EngineConfig(**values)
    assert dataclasses.asdict(config) == values  # dtype stays "auto" under q8_0
    assert dataclasses.replace(config) == config


def test_input_forms_are_converted_once_and_stably():
    config = EngineConfig(kv_cache_memory_bytes="1KiB", kv_cache_dtype="fp16",
                          speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.kv_cache_memory_bytes == 1024 and config.kv_cache_dtype == "float16"
    assert config.speculative_config.num_speculative_tokens == 2
    assert dataclasses.replace(config) == config


def test_with_resolved_defaults_returns_a_new_config():
    config = EngineConfig(dtype="auto", quantization="gguf", swap_space=1.0)
    before = dataclasses.replace(config)
    cpu = config.with_resolved_defaults("cpu")
    gpu = config.with_resolved_defaults("cuda")
    assert config == before and config.max_num_batched_tokens is None and config.dtype == "auto"
    assert cpu is not config
    # the numerics (dtype ...) are resolved from the hardware by runner.numerics, not here
    assert (cpu.max_num_batched_tokens, cpu.dtype, cpu.preemption_mode) == (1024, "auto", "recompute")
    assert cpu.max_mixed_prefill_tokens == 512  # half the step budget on CPU, no cap on GPU
    assert (gpu.max_num_batched_tokens, gpu.dtype, gpu.preemption_mode) == (2048, "auto", "swap")
    assert gpu.max_mixed_prefill_tokens is None
    assert dataclasses.replace(cpu, max_num_batched_tokens=None, max_mixed_prefill_tokens=None,
                               preemption_mode=None) == config
    explicit = EngineConfig(max_num_batched_tokens=96, preemption_mode="swap").with_resolved_defaults("cpu")
    assert (explicit.max_num_batched_tokens, explicit.preemption_mode) == (96, "swap")
    assert explicit.max_mixed_prefill_tokens == 48
    assert EngineConfig(enable_chunked_prefill=False).with_resolved_defaults("cpu").max_mixed_prefill_tokens is None
    given = EngineConfig(max_mixed_prefill_tokens=1024).with_resolved_defaults("cpu")
    assert given.max_mixed_prefill_tokens == 1024
    assert EngineConfig().with_resolved_defaults("cuda").preemption_mode == "recompute"  # no swap space


def test_the_usable_cpus_are_the_affinity_mask_not_the_machine(monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 5, 7}, raising=False)
    assert usable_cpu_count() == 3  # `taskset -c 2,5,7`, a container's cpuset
    monkeypatch.delattr(os, "sched_getaffinity")
    assert usable_cpu_count() == 64  # an OS without affinity masks


def test_each_data_parallel_core_gets_its_share_of_the_cpu_and_its_lanes_step_cap():
    plain = EngineConfig(data_parallel_size=2)
    assert [plain.for_data_parallel_core(i, 8).num_threads for i in range(2)] == [4, 4]
    assert plain.for_data_parallel_core(0, 1).num_threads == 1
    assert EngineConfig(data_parallel_size=2, num_threads=3).for_data_parallel_core(0, 8).num_threads == 3
    assert plain.for_data_parallel_core(0, 8).long_prefill_token_threshold is None  # no lanes: no cap
    # Length-aware lanes: the short lane's cores cap a long prompt's step unless the user did; the long
    # lane's core (the last) runs whole chunks.
    lanes = EngineConfig(data_parallel_size=3, data_parallel_long_prompt_threshold=1000)
    assert [lanes.for_data_parallel_core(i, 6).long_prefill_token_threshold for i in range(3)] == [256, 256, None]
    low = dataclasses.replace(lanes, data_parallel_long_prompt_threshold=100)
    assert low.for_data_parallel_core(0, 6).long_prefill_token_threshold == 100
    given = dataclasses.replace(lanes, long_prefill_token_threshold=900)
    assert [given.for_data_parallel_core(i, 6).long_prefill_token_threshold for i in range(3)] == [900] * 3
    strict = dataclasses.replace(lanes, data_parallel_long_prompt_borrowing=False)  # no borrowed prompt to cap
    assert strict.for_data_parallel_core(0, 6).long_prefill_token_threshold is None
    unchunked = dataclasses.replace(lanes, enable_chunked_prefill=False)
    assert unchunked.for_data_parallel_core(0, 6).long_prefill_token_threshold is None


def test_without_chunked_prefill_a_defaulted_budget_is_resolved_to_the_model_length_before_anything_is_built():
    # The executor profiles memory with the resolved budget, so it must already be the step the engine runs.
    config = EngineConfig(enable_chunked_prefill=False).with_resolved_defaults("cuda", max_model_len=8192)
    assert config.max_num_batched_tokens == 8192
    assert EngineConfig(enable_chunked_prefill=False).with_resolved_defaults("cpu", 512).max_num_batched_tokens == 1024
    given = EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=300)
    assert given.with_resolved_defaults("cpu", 8192).max_num_batched_tokens == 300  # the engine core refuses it
    assert EngineConfig().with_resolved_defaults("cuda", 8192).max_num_batched_tokens == 2048


def test_every_scheduling_policy_name_has_a_policy():
    from tokenmill.core.policy import make_policy

    assert [make_policy(name).name for name in SCHEDULING_POLICIES] == list(SCHEDULING_POLICIES)
    with pytest.raises(ValueError, match="fcfs, priority, fair, lpm"):
        make_policy("sjf")


def test_the_scheduler_reads_the_resolved_engine_config_under_the_names_the_user_typed():
    from tokenmill.core.kv_cache_manager import KVCacheManager
    from tokenmill.core.policy import LongestPrefixMatchPolicy
    from tokenmill.core.scheduler import Scheduler

    config = EngineConfig(max_num_seqs=3, scheduling_policy="lpm", lpm_max_wait=2.5, max_queue_time=1.5)
    with pytest.raises(ValueError, match="with_resolved_defaults"):
        Scheduler(config, 300, KVCacheManager(8, 4))
    scheduler = Scheduler(config.with_resolved_defaults("cpu", 300), 300, KVCacheManager(8, 4))
    assert isinstance(scheduler.policy, LongestPrefixMatchPolicy) and scheduler.policy.max_wait_s == 2.5
    assert scheduler.config.max_queue_time == 1.5 and scheduler.max_model_len == 300


def test_config_imports_without_torch():
    code = "import sys, tokenmill.config, tokenmill.entrypoints.engine_args; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0
