"""benchmarks.decode_floor: the bytes one decode token reads (every weight once, an embedding table only where
it is also the head), the bandwidth probe, and one stream's rounds against the floor."""
from __future__ import annotations

import json

import torch

from benchmarks import decode_floor
from tokenmill import LLM
from tokenmill.runner.model_memory import tensor_storages


def _model(llm):
    return llm.llm_engine.core.core.runner.model


def test_an_untied_embedding_is_left_out_and_a_tied_one_is_the_head(tiny_llama_dir, smollm2_path):
    untied = LLM(str(tiny_llama_dir), num_kv_blocks=16, numerics="exact")
    model = _model(untied)
    assert model.lm_head is not None
    everything = sum({**tensor_storages(model)[1], **tensor_storages(model)[0]}.values())
    embedding = model.embed_tokens.weight
    assert decode_floor.weight_bytes_per_token(model) == everything - embedding.numel() * embedding.element_size()
    tied = LLM(str(smollm2_path), num_kv_blocks=16)  # the embedded GGUF: the head's blocks are the embedding
    model = _model(tied)
    weights, buffers = tensor_storages(model)
    assert decode_floor.weight_bytes_per_token(model) == sum({**buffers, **weights}.values())
    head = sum(tensor_storages(model.lm_head)[0].values())
    assert head > 0.15 * decode_floor.weight_bytes_per_token(model)  # 49,152 x 576 blocks: a large share


def test_the_probe_and_the_rounds(tiny_llama_dir, tmp_path, capsys):
    rates = decode_floor.read_bandwidth(16 << 20, passes=2, allocations=2)
    assert len(rates) == 2 and all(rate > 1e8 for rate in rates)
    out = tmp_path / "floor.json"
    decode_floor.main(["--model", str(tiny_llama_dir), "--output-len", "8", "--rounds", "2", "--buffer-gib",
                       "0.02", "--json", str(out), "num_kv_blocks=16"])
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 2 and result["engine_options"] == {"num_kv_blocks": 16}
    for row in result["rounds"]:
        assert row["ms_per_token"] > 0
        assert abs(row["share_of_floor"] - row["floor_ms"] / row["ms_per_token"]) < 1e-9
    assert result["share_of_floor_range"][0] <= result["share_of_floor"] <= result["share_of_floor_range"][1]
    assert "avx2" in result["machine"]["cpu_flags"] or torch.backends.cpu.get_cpu_capability() == "DEFAULT"
