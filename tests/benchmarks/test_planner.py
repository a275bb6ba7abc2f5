"""`tokenmill plan`: KV and weight arithmetic, headroom, tensor parallelism, devices needed, profile crossing."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from tokenmill.entrypoints import cli
from tokenmill.errors import InvalidRequestError
from tokenmill.planning.gpus import KNOWN_GPUS, custom_device, find_gpu, load_price_table
from tokenmill.planning.planner import (
    PRESETS,
    PlanInputs,
    estimate_params,
    format_plan,
    make_plan,
    profile_crossing,
    resolve_model,
)

KIB, GIB = 1024, 2**30


def test_kv_bytes_per_token_match_hand_calculations():
    # 2 (K, V) × layers × KV heads × head_dim × 2 bytes (fp16)
    assert PRESETS["llama-3-8b"].kv_bytes_per_token(2) == 32 * 8 * 128 * 2 * 2 == 128 * KIB
    assert PRESETS["llama-3-70b"].kv_bytes_per_token(2) == 80 * 8 * 128 * 2 * 2 == 320 * KIB
    assert PRESETS["qwen2.5-7b"].kv_bytes_per_token(2) == 28 * 4 * 128 * 2 * 2
    assert PRESETS["mistral-7b"].kv_bytes_per_token(2) == 128 * KIB
    assert PRESETS["smollm2-135m"].kv_bytes_per_token(2) == 30 * 3 * 64 * 2 * 2
    assert PRESETS["gemma3-270m"].kv_bytes_per_token(2) == 18 * 1 * 256 * 2 * 2 == 18 * KIB
    # An int8 KV cache: one byte per value and a float16 scale per 32 values, as the engine stores it.
    assert PRESETS["llama-3-8b"].int8_kv_scale_bytes() == 8
    plan = make_plan(PlanInputs(PRESETS["llama-3-8b"], custom_device(100), max_model_len=1024,
                                kv_cache_dtype="int8"))
    assert plan["kv_bytes_per_token"] == 32 * 8 * 136 * 2 and plan["dtype"] == "bfloat16"
    assert "(128 + 8 scales) dim" in format_plan(plan)


def test_planner_refuses_kv_dtypes_the_engine_cannot_store():
    with pytest.raises(InvalidRequestError, match="caches the engine stores"):
        make_plan(PlanInputs(PRESETS["llama-3-8b"], custom_device(100), max_model_len=1024, kv_cache_dtype="fp8"))


def test_planner_and_engine_agree_on_int8_kv_rows():
    import torch

    from tokenmill.runner.kv_cache import KVCacheSpec

    for name in ("llama-3-8b", "smollm2-135m", "gemma3-270m"):
        model = PRESETS[name]
        spec = KVCacheSpec(model.num_layers, 16, model.num_kv_heads, model.head_dim, torch.int8)
        assert spec.bytes_per_block == 16 * model.kv_bytes_per_token(1, model.int8_kv_scale_bytes())


def test_headroom_weights_and_devices_needed():
    model, device = PRESETS["llama-3-8b"], custom_device(100)
    plan = make_plan(PlanInputs(model, device, max_model_len=8192, concurrency=100, headroom=0.3, dtype="float16"))
    weights = 8_030_261_248 * 2
    usable = 100 * GIB * 0.7
    assert plan["weights_bytes"] == weights and plan["usable_bytes_per_device"] == pytest.approx(usable)
    assert plan["kv_bytes_per_device"] == pytest.approx(usable - weights)
    assert plan["kv_tokens_per_replica"] == int((usable - weights) // (128 * KIB))
    per_replica = plan["kv_tokens_per_replica"] // 8192
    assert plan["max_concurrency_per_replica"] == per_replica == 55  # (70 − 14.96 GiB) / 1 GiB per sequence
    assert plan["tensor_parallel_size"] == 1
    assert plan["replicas_needed"] == math.ceil(100 / per_replica) == 2 and plan["devices_needed"] == 2
    # More headroom, less KV room: fewer sequences per device.
    tighter = make_plan(PlanInputs(model, device, max_model_len=8192, concurrency=100, headroom=0.5, dtype="float16"))
    assert tighter["usable_bytes_per_device"] == pytest.approx(50 * GIB)
    assert tighter["max_concurrency_per_replica"] == int((50 * GIB - weights) // (128 * KIB)) // 8192 == 35
    assert tighter["devices_needed"] == 3
    # A context that is not a whole number of 16-token blocks takes whole blocks.
    odd = make_plan(PlanInputs(model, device, max_model_len=8200, headroom=0.3, dtype="float16"))
    assert odd["kv_bytes_per_sequence"] == 8208 * 128 * KIB


def test_tensor_parallel_when_weights_do_not_fit_one_device():
    model = PRESETS["llama-3-70b"]
    plan = make_plan(PlanInputs(model, find_gpu("A100-80GB"), max_model_len=8192, concurrency=64, dtype="fp16"))
    weights = 70_553_706_496 * 2
    assert plan["tensor_parallel_size"] == 4  # TP 2 leaves 65.7 GiB of weights on a 56 GiB budget
    kv_per_device = 80 * GIB * 0.7 - weights / 4
    assert plan["kv_bytes_per_device"] == pytest.approx(kv_per_device)
    # Each of the 4 ranks holds 2 of the 8 KV heads: a token costs a quarter of 320 KiB per rank.
    assert plan["kv_tokens_per_replica"] == int(kv_per_device // (320 * KIB / 4))
    assert plan["devices_needed"] == math.ceil(64 / plan["max_concurrency_per_replica"]) * 4
    # Q8_0 blocks: 8.5 bits a weight, 75 GB, within an H200's 70%.
    assert make_plan(PlanInputs(model, find_gpu("h200"), max_model_len=8192, dtype="q8_0"))["tensor_parallel_size"] == 1
    with pytest.raises(InvalidRequestError, match="does not fit"):
        make_plan(PlanInputs(model, custom_device(1), max_model_len=8192))


def test_profile_crossing_interpolates_p95_ttft():
    profile = {"points": [
        {"max_concurrency": 1, "p95_ttft_ms": 100.0, "server": {"queue_depth_p95": 0.0}},
        {"max_concurrency": 4, "p95_ttft_ms": 200.0, "server": {"queue_depth_p95": 0.0}},
        {"max_concurrency": 16, "p95_ttft_ms": 600.0, "server": {"queue_depth_p95": 6.0}},
    ]}
    out = profile_crossing(profile, 400.0)
    assert out["crossing_concurrency"] == pytest.approx(10.0) and out["ttft_bound_concurrency"] == 10
    assert out["queue_depth_p95_at_crossing"] == pytest.approx(3.0)
    assert profile_crossing(profile, 1000.0)["crossing_concurrency"] is None
    assert profile_crossing(profile, 50.0)["ttft_bound_concurrency"] == 1
    plan = make_plan(PlanInputs(PRESETS["llama-3-8b"], find_gpu("H100-80GB"), max_model_len=4096, concurrency=50,
                                target_ttft_ms=400, profile=profile))
    assert plan["concurrency_per_replica"] == 10 and plan["replicas_needed"] == 5
    assert plan["scale_out_trigger"]["p95_queue_depth"] == 3 and plan["scale_out_trigger"]["p95_ttft_ms"] == 400
    assert "P95 TTFT > 400 ms" in plan["scale_out_trigger"]["text"]
    with pytest.raises(InvalidRequestError, match="bench sweep"):
        profile_crossing({"points": []}, 100)


def test_a_price_per_device_hour_gives_the_plan_its_cost_per_token(capsys):
    profile = {"points": [
        {"max_concurrency": 1, "p95_ttft_ms": 100.0, "output_throughput": 100.0},
        {"max_concurrency": 4, "p95_ttft_ms": 200.0, "output_throughput": 300.0},
        {"max_concurrency": 16, "p95_ttft_ms": 600.0, "output_throughput": 900.0},
    ]}
    plan = make_plan(PlanInputs(PRESETS["llama-3-8b"], find_gpu("H100-80GB"), max_model_len=4096, concurrency=50,
                                target_ttft_ms=400, profile=profile, price_per_device_hour=3.0))
    cost = plan["cost"]
    # 5 replicas of one device; each runs at concurrency 10, where the sweep measured 600 tok/s (interpolated).
    assert cost["devices"] == 5 and cost["per_hour"] == 15.0 and cost["replica_output_tok_s"] == pytest.approx(600.0)
    assert cost["per_million_output_tokens"] == pytest.approx(3.0 / (600.0 * 3600) * 1e6)
    no_profile = make_plan(PlanInputs(PRESETS["llama-3-8b"], find_gpu("H100-80GB"), max_model_len=4096,
                                      price_per_device_hour=3.0))["cost"]
    assert no_profile["per_hour"] == 3.0 and no_profile["per_million_output_tokens"] is None
    with pytest.raises(InvalidRequestError, match="price-per-hour"):
        make_plan(PlanInputs(PRESETS["llama-3-8b"], find_gpu("H100-80GB"), price_per_device_hour=0.0))
    assert cli.main(["plan", "--model", "llama-3-8b", "--gpu", "H100-80GB", "--concurrency", "8",
                     "--price-per-hour", "2.5"]) == 0
    assert "2.50 an hour (1 device(s) × 2.5)" in capsys.readouterr().out


def test_hf_directory_config_and_safetensors_count(tmp_path):
    from safetensors.torch import save_file

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 3, "intermediate_size": 128, "vocab_size": 100,
              "max_position_embeddings": 256, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = resolve_model(str(tmp_path))
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.default_dtype) == (3, 2, 16, "float16")
    assert spec.num_params == estimate_params(config)  # no weights: estimated from the config
    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7)}, str(tmp_path / "model.safetensors"))
    assert resolve_model(str(tmp_path)).num_params == 22
    with pytest.raises(InvalidRequestError, match="unknown model"):
        resolve_model("gpt-17")


def test_known_gpus_and_cli(capsys):
    for name in ("A100-40GB", "A100-80GB", "H100-80GB", "H200", "L4", "L40S", "A10G", "RTX-4090", "MI300X"):
        assert find_gpu(name).memory_gib > 0 and find_gpu(name).bandwidth_gbps > 0
    assert len(KNOWN_GPUS) >= 9
    code = cli.main(["plan", "--model", "llama-3-8b", "--gpu", "H100", "--max-model-len", "8192",
                           "--concurrency", "128"])
    text = capsys.readouterr().out
    assert code == 0 and "128.0 KiB" in text and "devices" in text and "scale-out trigger" in text
    code = cli.main(["plan", "--model", "llama-3-8b", "--memory-gib", "100", "--max-model-len", "8192",
                           "--concurrency", "100", "--dtype", "fp16", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["devices_needed"] == 2
    code = cli.main(["plan", "--model", "llama-3-8b", "--gpu", "Z100", "--concurrency", "1"])
    assert code == 1 and capsys.readouterr().err.strip() == (
        "tokenmill: error: unknown GPU 'Z100'; known: A100-40GB, A100-80GB, H100-80GB, H200, L4, L40S, A10G, "
        "RTX-4090, MI300X (or give --memory-gib)")


@pytest.mark.slow
def test_gemma3_270m_preset_matches_its_gguf(gemma3_270m_gguf):
    """The preset's numbers are the ones `tokenmill plan --model <the gguf>` reads from the file."""
    from dataclasses import replace

    from_file = resolve_model(str(gemma3_270m_gguf))
    assert replace(from_file, name="gemma3-270m") == PRESETS["gemma3-270m"]


def test_printed_serve_flags_are_flags_the_server_accepts():
    import argparse
    import shlex

    from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args

    plan = make_plan(PlanInputs(PRESETS["llama-3-70b"], find_gpu("A100-80GB"), max_model_len=8192, concurrency=64,
                                dtype="fp16"))
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(shlex.split(plan["serve_flags"])))
    assert config.tensor_parallel_size == plan["tensor_parallel_size"] == 4
    assert config.data_parallel_size == plan["replicas_needed"]
    # Only sizes that split the heads evenly, as the engine requires.
    with pytest.raises(InvalidRequestError, match="does not divide smollm2-135m's 9 attention and 3 KV heads"):
        make_plan(PlanInputs(PRESETS["smollm2-135m"], find_gpu("A100-80GB"), max_model_len=1024,
                             tensor_parallel_size=2))


def test_an_operators_price_table_prices_the_plan(tmp_path, capsys):
    table = tmp_path / "prices.json"
    table.write_text(json.dumps({"h100": 3.0, "L4": 0.8, "cpu": 0.4}))
    assert cli.main(["plan", "--model", "llama-3-8b", "--gpu", "H100-80GB", "--concurrency", "8",
                     "--price-table", str(table), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost"]["per_hour"] == 3.0  # "h100" is an alias of H100-80GB
    assert cli.main(["plan", "--model", "smollm2-135m", "--memory-gib", "16", "--price-table", str(table),
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost"]["price_per_device_hour"] == 0.4  # a CPU host
    # --price-per-hour wins; a device the table lacks gets no cost and a note.
    assert cli.main(["plan", "--model", "llama-3-8b", "--gpu", "H100", "--price-table", str(table),
                     "--price-per-hour", "2.0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost"]["per_hour"] == 2.0
    assert cli.main(["plan", "--model", "llama-3-8b", "--gpu", "A100-80GB", "--price-table", str(table),
                     "--json"]) == 0
    captured = capsys.readouterr()
    assert "cost" not in json.loads(captured.out) and "no price for A100-80GB" in captured.err
    table.write_text(json.dumps({"TPU-v9": 1.0}))
    with pytest.raises(InvalidRequestError, match="unknown device"):
        load_price_table(str(table))


def test_planner_refuses_weight_formats_the_engine_does_not_serve():
    with pytest.raises(InvalidRequestError, match="not a format tokenmill serves.*float32, float16, bfloat16, int8"):
        make_plan(PlanInputs(PRESETS["llama-3-8b"], custom_device(100), max_model_len=1024, dtype="fp8"))


def test_sliding_window_layers_hold_their_window_only():
    """Gemma 3 270M at 32k tokens: 3 global layers hold 2,048 blocks each, 15 local ones the 32 blocks their
    512-token window reaches (33 where the window starts inside a block; core/kv_cache_groups.py)."""
    model = PRESETS["gemma3-270m"]
    per_layer_block = 2 * 16 * model.num_kv_heads * model.head_dim * 2  # bfloat16
    assert model.kv_bytes_per_sequence(32768, 16, 2) == (3 * 2048 + 15 * 32) * per_layer_block
    assert model.kv_bytes_per_sequence(32760, 16, 2) == (3 * 2048 + 15 * 33) * per_layer_block
    assert model.kv_bytes_per_sequence(32768, 16, 2) < model.kv_bytes_per_token(2) * 32768 / 5


def _engine_and_plan(model_path, spec, budget: int, max_model_len: int) -> tuple[float, float]:
    """(the engine's start-up max concurrency, the planner's) for one KV budget."""
    from tokenmill import LLM

    llm = LLM(model=str(model_path), kv_cache_memory_bytes=budget, max_model_len=max_model_len)
    core = llm.llm_engine.core.core
    engine = core.max_concurrency
    kv_dtype = str(core.config.kv_cache_dtype)
    device = custom_device(budget / 2**30)  # the whole device is the KV budget: no weights, no headroom
    plan = make_plan(PlanInputs(replace(spec, num_params=0), device, max_model_len=max_model_len, headroom=0.0,
                                kv_cache_dtype=kv_dtype))
    return engine, budget / plan["kv_bytes_per_sequence"]


@pytest.mark.parametrize("which", ["smollm2", "gemma3", "llama-3.2-1b"])
def test_the_plan_agrees_with_the_engines_capacity_report(which, request, tmp_path):
    """Within 5%, at the same KV budget and context: the planner's sequences per budget and the engine's
    `max concurrency` (what its start-up log reports), sliding windows included (Gemma 3)."""
    if which == "smollm2":
        path = request.getfixturevalue("smollm2_path")
    elif which == "gemma3":
        path = request.getfixturevalue("gemma3_270m_gguf")
    else:  # the 1B shape at 2 layers and a small vocabulary: the same per-layer KV as the full model
        from benchmarks import make_checkpoint as mc

        path = mc.make_checkpoint(tmp_path, "llama-3.2-1b", "safetensors", layers=2, vocab_size=2048,
                                  shard_bytes=64 * 1024**2)
    engine, planned = _engine_and_plan(path, resolve_model(str(path)), 64 * 2**20, 2048)
    assert engine > 1 and planned == pytest.approx(engine, rel=0.05)
