"""LoRA adapters (--enable-lora): each adapter's greedy tokens equal HF transformers + PEFT's on the same
weights, with requests for different adapters and for the base model in the same steps; adapters beyond
--max-loras wait for a slot; the prefix cache never hands one adapter's blocks to another; bad adapters are
clear errors."""
from __future__ import annotations

import json

import pytest
import torch

from fused_decode import decode_step_both_ways
from model_factory import build_peft_adapter, hf_greedy, hf_with_adapter
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.errors import InvalidRequestError

PROMPTS = [list(range(300, 340)), list(range(1000, 1021)), [5, 17, 923, 44, 1200, 8, 77, 301, 12, 999] * 5]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_dir) -> list:
    """Three adapters: every projection (rank 8), attention only (rank 4, rsLoRA), MLP only (rank 16)."""
    root = tmp_path_factory.mktemp("adapters")
    specs = [dict(seed=1), dict(seed=2, rank=4, targets=("q_proj", "v_proj", "o_proj"), use_rslora=True),
             dict(seed=3, rank=16, alpha=8, targets=("gate_proj", "up_proj", "down_proj"))]
    return [LoRARequest(f"a{i}", i + 1, str(build_peft_adapter(root / f"a{i}", tiny_llama_dir, **spec)))
            for i, spec in enumerate(specs)]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, adapters) -> dict:
    """HF + PEFT's greedy tokens per (adapter index or None, prompt index)."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    out = {(None, p): hf_greedy(base, prompt, MAX_TOKENS) for p, prompt in enumerate(PROMPTS)}
    for a, lora in enumerate(adapters):
        hf = hf_with_adapter(tiny_llama_dir, lora.lora_path)
        out.update({(a, p): hf_greedy(hf, prompt, MAX_TOKENS) for p, prompt in enumerate(PROMPTS)})
    return out


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def engine(model, **kwargs) -> LLM:
    settings = dict(enable_lora=True, max_loras=2, num_kv_blocks=96, max_model_len=256, numerics="exact",
                    max_num_batched_tokens=48)
    return LLM(str(model), **{**settings, **kwargs})


@pytest.mark.parametrize("backend, budget", [("cpu", 48), ("torch", 48), ("torch", 256)])
def test_mixed_adapters_in_one_batch_match_hf_and_peft(request, tiny_llama_dir, adapters, expected, backend, budget,
                                                       monkeypatch):
    """Every (adapter, prompt) pair and the base model at once: steps mix adapters and base rows, prompts
    are chunked, and the third adapter waits for one of the two slots. With the C++ kernels every row takes its
    own adapter in `lora_add`; without them a 48-token budget keeps every step on the masked path, and at 256
    the prompt steps take the grouped one (a counter of its uses proves it)."""
    from tokenmill.model.layers import lora as lora_layers

    if backend == "cpu":
        request.getfixturevalue("kernels")
    grouped = []
    original = lora_layers.LoRAStepState.set_rows

    def counting(state, token_slots, num_slots, device):
        original(state, token_slots, num_slots, device)
        grouped.append(state.order is not None)

    monkeypatch.setattr(lora_layers.LoRAStepState, "set_rows", counting)
    llm = engine(tiny_llama_dir, max_num_batched_tokens=budget, attention_backend=backend)
    pairs = [(a, p) for a in (None, 0, 1, 2) for p in range(len(PROMPTS))]
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[p]} for _, p in pairs], params(), use_tqdm=False,
                           lora_request=[None if a is None else adapters[a] for a, _ in pairs])
    for (a, p), out in zip(pairs, outputs):
        assert out.outputs[0].token_ids == expected[(a, p)], f"adapter {a}, prompt {p}"
    slots = llm.llm_engine.core.core.runner.lora
    assert slots.num_slot_loads >= 3 and len(slots.slots) == 2
    assert (slots.state.kernel is not None) == (backend == "cpu")
    # A slot: A [in, 3 parts * rank 16] and B [rank 16, out] of every projection of both layers, float32.
    per_layer = (64 * 3 * 16 + 16 * 128) + (64 * 16 + 16 * 64) + (64 * 2 * 16 + 16 * 256) + (128 * 16 + 16 * 64)
    assert slots.slot_bytes == 2 * per_layer * 4
    assert any(grouped) == (backend == "torch" and budget > lora_layers.GROUPED_MIN_ROWS) and not all(grouped)


def test_the_prefix_cache_keeps_adapters_apart(tiny_llama_dir, adapters, expected):
    llm = engine(tiny_llama_dir)
    run = lambda lora: llm.generate([{"prompt_token_ids": PROMPTS[0]}], params(), use_tqdm=False,  # noqa: E731
                                    lora_request=lora)[0]
    first = run(adapters[0])
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == expected[(0, 0)]
    base = run(None)
    assert base.num_cached_tokens == 0 and base.outputs[0].token_ids == expected[(None, 0)]
    other = run(adapters[1])
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids == expected[(1, 0)]
    again = run(adapters[0])
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == expected[(0, 0)]
    # LLM.chat takes an adapter as generate does.
    messages = [{"role": "user", "content": "Name three rivers."}]
    chat = llm.chat(messages, params(), use_tqdm=False, lora_request=adapters[1])[0]
    same = llm.generate([{"prompt_token_ids": chat.prompt_token_ids}], params(), use_tqdm=False,
                        lora_request=adapters[1])[0]
    assert chat.outputs[0].token_ids == same.outputs[0].token_ids
    assert chat.outputs[0].token_ids != llm.chat(messages, params(), use_tqdm=False)[0].outputs[0].token_ids


def test_an_adapter_on_the_embedded_gguf_matches_peft(smollm2_path, smollm2_hf, tmp_path):
    """Kept Q4_1 blocks (widened to float32 in the exact mode) with an adapter's delta on top, against PEFT
    on transformers' dequantized copy of the same file."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(smollm2_hf, config)
    try:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.02 if "lora_B" in name else 1.0 / param.shape[-1] ** 0.5)
        peft_model.save_pretrained(tmp_path / "smollm2-lora")
        prompt = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 2683, 314, 260, 3458]
        want = hf_greedy(peft_model, prompt, 12)
    finally:
        peft_model.unload()  # the session's HF model back to itself
    llm = LLM(str(smollm2_path), enable_lora=True, numerics="exact", num_kv_blocks=64, max_model_len=256)
    runner = llm.llm_engine.core.core.runner
    assert runner.num_gguf_layers_kept > 0
    lora = LoRARequest("smol", 1, str(tmp_path / "smollm2-lora"))
    fused = runner.model._forward_int8_decode
    fused_with_adapter = []
    runner.model._forward_int8_decode = lambda *args: fused_with_adapter.append(
        runner.model.lora_state.token_slots is not None) or fused(*args)
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False, lora_request=lora)[0]
    assert got.outputs[0].token_ids == want
    # The prefill step and every decode step ran the fused stack with the adapter's deltas.
    assert fused_with_adapter.count(True) == 12


@pytest.mark.parametrize("block_matmul, weights", [("float32", torch.float32), ("int8", torch.bfloat16)])
def test_the_fused_decode_stack_adds_each_rows_adapter_as_the_layers_do(kernels, tiny_llama_dir, adapters,
                                                                          smollm2_tokenizer, block_matmul, weights):
    """A decode step mixing two adapters and the base model through the one-call C++ decoder stack: the same
    hidden states and KV writes as the layer-by-layer modules (the same lora_add after each projection). Where
    the projections round activations to int8, the adapters' weights are kept in bfloat16."""
    llm = engine(tiny_llama_dir, quantization="q8_0", max_loras=2, dtype="float32", block_matmul=block_matmul,
                 numerics="auto", kv_cache_dtype="float32")
    model = llm.llm_engine.core.core.runner.model
    assert model._int8_decode is not None
    assert model.layers[0].self_attn.qkv_proj.lora_a.dtype == weights
    step = decode_step_both_ways(llm, PROMPTS, max_tokens=6, lora_request=[adapters[0], None, adapters[2]])
    slots = model.lora_state.token_slots.tolist()
    assert step.fused_calls >= 5 and -1 in slots and len(set(slots)) == 3  # the base model's row and two adapters
    assert torch.equal(step.fused_hidden, step.layered_hidden)
    assert all(torch.equal(a, b) for a, b in zip(step.fused_caches, step.layered_caches))
    # The deltas are there: the same step without adapters differs.
    model.lora_state.clear()
    with torch.inference_mode():
        plain = model(*step.args, **step.kwargs)
    assert not torch.equal(plain, step.fused_hidden)


def test_bad_adapters_are_clear_errors(tiny_llama_dir, adapters, tmp_path):
    plain = LLM(str(tiny_llama_dir), num_kv_blocks=32, max_model_len=128)
    with pytest.raises(InvalidRequestError, match="without --enable-lora"):
        plain.generate("hi", params(), lora_request=adapters[0])
    llm = engine(tiny_llama_dir, max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match="rank 16, above --max-lora-rank 8"):
        llm.generate("hi", params(), lora_request=adapters[2])
    with pytest.raises(InvalidRequestError, match="cannot be read"):
        llm.generate("hi", params(), lora_request=LoRARequest("gone", 9, str(tmp_path / "missing")))
    dora = tmp_path / "dora"
    dora.mkdir()
    source = adapters[0].lora_path
    config = json.loads(open(f"{source}/adapter_config.json").read())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(open(f"{source}/adapter_model.safetensors", "rb").read())
    with pytest.raises(InvalidRequestError, match="DoRA"):
        llm.generate("hi", params(), lora_request=LoRARequest("dora", 10, str(dora)))
    assert llm.generate("hi", params())[0].outputs[0].token_ids  # the engine serves on


@pytest.mark.slow
def test_two_tensor_parallel_ranks_apply_their_shards_of_each_adapter(tiny_llama_dir, adapters, expected):
    """Column-parallel projections hold their rows of B, row-parallel ones their columns of A: the ranks'
    partial deltas sum, with the base's, in the same all-reduce."""
    llm = engine(tiny_llama_dir, tensor_parallel_size=2)
    pairs = [(a, p) for a in (None, 0, 1) for p in range(2)]
    try:
        outputs = llm.generate([{"prompt_token_ids": PROMPTS[p]} for _, p in pairs], params(), use_tqdm=False,
                               lora_request=[None if a is None else adapters[a] for a, _ in pairs])
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [expected[pair] for pair in pairs]


def test_a_second_adapter_waits_for_the_first_under_max_loras_1(tiny_llama_dir, adapters, expected):
    """--max-loras 1: requests of a second adapter wait (they are not admitted) while the first one's run,
    as /stats and the scheduler's stats count them; then they run, with their own tokens."""
    llm = engine(tiny_llama_dir, max_loras=1, max_num_batched_tokens=256)
    core = llm.llm_engine.core.core
    processor = llm.llm_engine.input_processor
    for i, lora in enumerate([adapters[0], adapters[0], adapters[1], None]):
        llm.llm_engine.add_request(f"r{i}", processor.process_prompt({"prompt_token_ids": PROMPTS[0]}), params(),
                                   lora_request=lora)
    llm.llm_engine.step()
    stats = core.scheduler.get_stats()
    assert stats.lora_running == {"a0": 2} and stats.lora_waiting == {"a1": 1}
    assert stats.num_running == 3  # the base model's request is not held back
    finished = {}
    while llm.llm_engine.has_unfinished_requests():
        for output in llm.llm_engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert finished == {"r0": expected[(0, 0)], "r1": expected[(0, 0)], "r2": expected[(1, 0)],
                        "r3": expected[(None, 0)]}


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "phi3"])
def test_adapters_on_other_families_match_hf_and_peft(tmp_path_factory, smollm2_tokenizer, family):
    """Qwen3 (q/k norms), Gemma 3 (sandwich norms, sliding windows) and Phi-3, whose checkpoints fuse q/k/v and
    gate/up (its adapters target qkv_proj and gate_up_proj: one A, B's rows split by part)."""
    from model_factory import build_tiny_family

    base = build_tiny_family(tmp_path_factory.mktemp(f"lora-{family}"), smollm2_tokenizer, family)
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if family == "phi3" else \
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter = build_peft_adapter(tmp_path_factory.mktemp(f"lora-{family}-adapter"), base, seed=21, rank=8,
                                 targets=targets)
    want = hf_greedy(hf_with_adapter(base, adapter), PROMPTS[0], MAX_TOKENS)
    llm = engine(base, max_model_len=192)
    got = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params(), use_tqdm=False,
                       lora_request=LoRARequest("x", 1, str(adapter)))[0]
    assert got.outputs[0].token_ids == want


def test_an_adapter_of_another_model_is_refused(tiny_llama_dir, adapters, tmp_path_factory,
                                                                 smollm2_tokenizer):
    """A projection of other dimensions (an adapter made for a wider model) and fused targets on a model whose
    checkpoints name q/k/v apart are 400s before any step."""
    import shutil

    from safetensors.torch import load_file, save_file

    from model_factory import build_tiny_family

    foreign = tmp_path_factory.mktemp("lora-foreign")
    shutil.copy(f"{adapters[0].lora_path}/adapter_config.json", foreign)
    tensors = load_file(f"{adapters[0].lora_path}/adapter_model.safetensors")
    name = next(n for n in tensors if n.endswith("q_proj.lora_A.weight"))
    tensors[name] = torch.randn(tensors[name].shape[0], 96)  # the inputs of a model with hidden size 96
    save_file(tensors, str(foreign / "adapter_model.safetensors"))
    llm = engine(tiny_llama_dir)
    with pytest.raises(InvalidRequestError, match="an adapter of another model"):
        llm.generate("hi", params(), lora_request=LoRARequest("foreign", 1, str(foreign)))
    phi3 = build_tiny_family(tmp_path_factory.mktemp("lora-phi3"), smollm2_tokenizer, "phi3")
    fused = build_peft_adapter(tmp_path_factory.mktemp("lora-fused"), phi3, seed=5, targets=("qkv_proj",))
    with pytest.raises(InvalidRequestError, match="does not have as a separate projection"):
        llm.generate("hi", params(), lora_request=LoRARequest("fused", 2, str(fused)))
    assert llm.generate("hi", params())[0].outputs[0].token_ids  # the engine serves on


@pytest.mark.parametrize("family", ["mixtral", "qwen3moe"])
def test_adapters_on_the_attention_of_moe_models_match_hf_and_peft(tmp_path_factory, smollm2_tokenizer, family):
    """Mixture-of-experts models take adapters on their attention projections (the experts' MLP: a 400)."""
    from model_factory import build_tiny_family

    base = build_tiny_family(tmp_path_factory.mktemp(f"lora-{family}"), smollm2_tokenizer, family)
    adapter = build_peft_adapter(tmp_path_factory.mktemp(f"lora-{family}-attn"), base, seed=23, rank=8,
                                 targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    want = hf_greedy(hf_with_adapter(base, adapter), PROMPTS[0], MAX_TOKENS)
    llm = engine(base, max_model_len=192)
    lora = LoRARequest("attn", 1, str(adapter))
    got = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}], params(),
                       use_tqdm=False, lora_request=[lora, None])
    assert got[0].outputs[0].token_ids == want
    assert got[0].outputs[0].token_ids != llm.generate([{"prompt_token_ids": PROMPTS[0]}], params(),
                                                       use_tqdm=False)[0].outputs[0].token_ids
    # PEFT cannot target transformers' fused experts, so the adapter of an MLP projection is written by hand.
    from safetensors.torch import load_file, save_file

    experts = tmp_path_factory.mktemp(f"lora-{family}-mlp")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = [*config["target_modules"], "gate_proj"]
    (experts / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    hidden = json.loads((base / "config.json").read_text())["hidden_size"]
    for layer in range(json.loads((base / "config.json").read_text())["num_hidden_layers"]):
        prefix = f"base_model.model.model.layers.{layer}.mlp.gate_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, hidden)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(32, 8)
    save_file(tensors, str(experts / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError, match="inside this model's mixture-of-experts layers"):
        llm.generate("hi", params(), lora_request=LoRARequest("experts", 2, str(experts)))
