"""Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3 and Phi-3 from tiny random checkpoints: greedy tokens
equal HF transformers' (fp32) under batching, chunked prefill, preemption and prefix-cache hits, from
safetensors and from a GGUF; sliding windows attend only their window; the MoE block routes and sums
as transformers' does; LongRoPE switches to its long factors past the original context; and which
configs cap the context."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fused_decode import decode_step_both_ways
from model_factory import GOLDEN_PROMPTS, build_tiny_family, hf_greedy, write_family_gguf
from tokenmill import LLM, SamplingParams

FAMILIES = ["qwen2", "qwen3", "gemma3", "phi3", "gemma2", "qwen3moe", "mixtral"]
GGUF_FAMILIES = FAMILIES
FUSED_STACK_BLOCKED = {"qwen3moe", "mixtral", "phi3"}  # experts; a partial rotary. The others: one C++ call
MAX_TOKENS = [12, 20, 5, 16, 24, 9, 30, 14, 22]


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, smollm2_tokenizer) -> dict[str, Path]:
    return {family: build_tiny_family(tmp_path_factory.mktemp(f"tiny-{family}"), smollm2_tokenizer, family)
            for family in FAMILIES}


def hf_model(directory: Path, weights: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if weights is not None:  # the values a GGUF stores (quantized projections)
        missing = model.load_state_dict(weights, strict=False).missing_keys
        assert all("lm_head" in name for name in missing), missing
        if model.config.tie_word_embeddings:  # the copied embedding must be the head as well
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def check_parity(llm: LLM, hf, tokenizer) -> None:
    """Nine prompts at once through a small budget (chunks) and 12 KV blocks (preemption); then the
    longest prompt again, served from the prefix cache."""
    prompt_ids = [tokenizer.encode(p) for p in GOLDEN_PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    expected = [hf_greedy(hf, ids, m) for ids, m in zip(prompt_ids, MAX_TOKENS)]
    for ids, out, want in zip(prompt_ids, outputs, expected):
        assert out.outputs[0].token_ids == want, f"mismatch for {tokenizer.decode(ids)!r}"
    core = llm.llm_engine.core.core
    assert core.scheduler.num_preemptions > 0
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    # Served alone, twice: the second run's prompt comes from the prefix cache (the squeeze above may have
    # evicted a windowed group's copy of a block the first run needed; the first run caches it again).
    for _ in range(2):
        again = llm.generate([{"prompt_token_ids": prompt_ids[longest]}], params[longest], use_tqdm=False)[0]
        assert again.outputs[0].token_ids == expected[longest]
    assert again.num_cached_tokens > 0
    assert core.kv_cache.usage == 0.0


# Gemma 3's local and global layers keep separate block tables (core.kv_cache_groups): six groups of one
# layer, so a block holds one layer's K/V and the same squeeze takes more of them.
KV_BLOCKS = {"gemma3": 60, "gemma2": 24}  # blocks shared by 6 and 2 layer groups (core.kv_cache_groups)


def engine(model: str, backend: str, family: str, **kwargs) -> LLM:
    return LLM(model, device="cpu", max_num_batched_tokens=24, num_kv_blocks=KV_BLOCKS.get(family, 12),
               max_model_len=192, attention_backend=backend, numerics="exact", **kwargs)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf(request, family_dirs, smollm2_tokenizer, family, backend):
    if backend == "cpu":
        request.getfixturevalue("kernels")
    directory = family_dirs[family]
    llm = engine(str(directory), backend, family)
    assert llm.llm_engine.core.core.runner.attention_backend.name == backend
    check_parity(llm, hf_model(directory), smollm2_tokenizer)


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_family_gguf_matches_hf(request, tmp_path, family_dirs, smollm2_tokenizer, family, caplog):
    """Q8_0 projections (kept as int8 blocks where the kernels build; Qwen3-MoE's stacked experts stay
    dense) and float norms: HF runs the very values the file stores. Qwen2's layers fit the fused int8
    decode stack; the others' do not (q/k norms, Gemma's norms, a partial rotary), which the runner logs."""
    from tokenmill.model.layers import cpu_kernels

    directory = family_dirs[family]
    path = tmp_path / f"{family}.gguf"
    stored = write_family_gguf(path, directory, family)
    backend = "cpu" if cpu_kernels.load() is not None else "torch"
    with caplog.at_level("INFO", logger="tokenmill"):
        llm = engine(str(path), backend, family, tokenizer=str(directory))
    runner = llm.llm_engine.core.core.runner
    assert type(runner.model).__name__ == runner.hf_config.architectures[0]
    if backend == "cpu":
        assert runner.num_gguf_layers_kept > 0
        fused = runner.model._int8_decode is not None
        assert fused == (family not in FUSED_STACK_BLOCKED)
        assert fused or "decode steps run layer by layer" in caplog.text
    check_parity(llm, hf_model(directory, stored), smollm2_tokenizer)


def test_gemma3_gguf_config_matches_hf(tmp_path, family_dirs):
    """The GGUF's metadata rebuilds the parts of Gemma3TextConfig the model reads."""
    from tokenmill.model.loader import load_model_source

    directory = family_dirs["gemma3"]
    path = tmp_path / "gemma3.gguf"
    write_family_gguf(path, directory, "gemma3")
    config = load_model_source(str(path), tokenizer=str(directory)).hf_config
    original = json.loads((directory / "config.json").read_text())
    assert config.layer_types == original["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config.sliding_window == original["sliding_window"] and config.head_dim == original["head_dim"]
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0


def test_new_family_gguf_configs_match_hf(tmp_path, family_dirs):
    """Phi-3's partial rotary and LongRoPE factors, Gemma 2's caps and window, Qwen3-MoE's experts and
    dense layers come back from the GGUF's metadata and tensor list."""
    from tokenmill.model.loader import load_model_source

    fields = {"phi3": ["rope_parameters", "original_max_position_embeddings", "sliding_window"],
              "gemma2": ["attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "layer_types",
                         "query_pre_attn_scalar", "head_dim"],
              "mixtral": ["num_local_experts", "num_experts_per_tok", "intermediate_size", "sliding_window"],
              "qwen3moe": ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                           "mlp_only_layers", "decoder_sparse_step"]}
    from transformers import AutoConfig

    for family, names in fields.items():
        directory = family_dirs[family]
        path = tmp_path / f"{family}.gguf"
        write_family_gguf(path, directory, family)
        config = load_model_source(str(path), tokenizer=str(directory)).hf_config
        original = AutoConfig.from_pretrained(directory)
        for name in names:
            assert _same(getattr(config, name), getattr(original, name)), (family, name)


def _same(a, b) -> bool:
    """Equal, floats up to float32 rounding (GGUF stores factors and caps as float32)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, rel=1e-6)
    return a == b


def test_unsupported_rope_is_a_load_error(tmp_path, family_dirs, smollm2_tokenizer):
    from tokenmill.errors import ModelLoadError

    directory = tmp_path / "phi3-odd-rope"
    directory.mkdir()
    for file in family_dirs["phi3"].iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    # 5 of 16 dimensions: transformers accepts the config, but an odd width has no rotate-half pairing.
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.3125}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        engine(str(directory), "torch", "phi3")


@pytest.mark.parametrize("window", [6, 40])  # 40: wider than every context (only the table's blocks are read)
def test_windowed_paged_decode_attends_only_the_window(window):
    from tokenmill.model.layers.attention.torch_backend import windowed_paged_decode

    torch.manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    cache = torch.randn(2, 12, block_size, kv_heads, dim)
    tables = torch.tensor([[3, 7, 1, 9, 0], [5, 2, 0, 0, 0], [11, 4, 6, 8, 10]], dtype=torch.int32)
    lengths = torch.tensor([19, 5, 20], dtype=torch.int32)
    q = torch.randn(3, heads, dim)
    out = windowed_paged_decode(q, cache, tables, lengths, 0.3, window)
    for row in range(3):
        length = int(lengths[row])
        slots = [int(tables[row, p // block_size]) * block_size + p % block_size
                 for p in range(max(0, length - window), length)]
        keys = cache[0].reshape(-1, kv_heads, dim)[slots].repeat_interleave(2, dim=1)  # [n, Hq, D]
        values = cache[1].reshape(-1, kv_heads, dim)[slots].repeat_interleave(2, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[row], keys) * 0.3, dim=-1)
        torch.testing.assert_close(out[row], torch.einsum("hn,nhd->hd", weights, values))


def test_sliding_window_caps_the_context_only_where_it_is_not_attended():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine_core import derive_max_model_len

    config = EngineConfig(model=None)
    # Qwen2 checkpoints carry a window with use_sliding_window false: nothing is windowed.
    qwen2 = Qwen2Config(max_position_embeddings=4096, sliding_window=1024, use_sliding_window=False,
                        architectures=["Qwen2ForCausalLM"])
    assert derive_max_model_len(config, qwen2) == 4096
    # Mistral's window is attended through: the context is the model's, not the window.
    mistral = MistralConfig(max_position_embeddings=8192, sliding_window=1024, architectures=["MistralForCausalLM"])
    assert derive_max_model_len(config, mistral) == 8192
    llama = LlamaConfig(max_position_embeddings=2048, architectures=["SomethingElse"])
    llama.sliding_window = 512  # a family that cannot window stays capped
    assert derive_max_model_len(config, llama) == 512


# ---- sliding-window KV memory ----------------------------------------------------------------------

WINDOW_FAMILIES = ["mistral", "gemma3"]
# Block tables of 4-token blocks; a chunk is at most 16 tokens. Mistral: one windowed group of both layers;
# Gemma 3: five local groups and one global group of one layer each.
WINDOW_KV_BLOCKS = {"mistral": 14, "gemma3": 80}


@pytest.fixture(scope="session")
def window_dirs(tmp_path_factory, smollm2_tokenizer, family_dirs) -> dict[str, Path]:
    mistral = build_tiny_family(tmp_path_factory.mktemp("tiny-mistral"), smollm2_tokenizer, "mistral")
    return {"mistral": mistral, "gemma3": family_dirs["gemma3"]}


def long_prompts(tokenizer) -> list[list[int]]:
    """Four prompts of 3-5 windows (12 tokens), two of them sharing a long prefix."""
    base = tokenizer.encode(GOLDEN_PROMPTS[7])
    return [base[:40], base[:40] + tokenizer.encode(" Because"), tokenizer.encode(GOLDEN_PROMPTS[3]) + base[:20],
            base[10:58]]


# The mixed-step cap cuts prompt chunks to 8 tokens beside decodes: other chunk shapes, preemptions and
# hits in a pool where a later group's hit can sit at the head of the free queue.
@pytest.mark.parametrize("family,backend,mixed_cap", [(family, backend, None) for family in WINDOW_FAMILIES
                                                      for backend in ("torch", "cpu")] + [("gemma3", "torch", 8)])
def test_sliding_window_kv_stays_bounded_and_matches_hf(request, window_dirs, smollm2_tokenizer, family, backend,
                                                        mixed_cap):
    """Prompts three windows and more, generating far past the window under chunked prefill, preemption and
    prefix-cache hits: greedy tokens equal HF's, and a windowed group never holds more blocks than its
    window (and the chunk being computed) can reach, while a global group holds the whole context."""
    if backend == "cpu":
        request.getfixturevalue("kernels")
    directory = window_dirs[family]
    llm = LLM(str(directory), device="cpu", block_size=4, max_num_batched_tokens=16, max_model_len=128,
              num_kv_blocks=WINDOW_KV_BLOCKS[family], attention_backend=backend,
              max_mixed_prefill_tokens=mixed_cap, numerics="exact")
    core = llm.llm_engine.core.core
    kv = core.kv_cache
    window, block = 12, 4
    assert set(kv.group_windows) == ({12} if family == "mistral" else {12, None})
    most_held = [0] * kv.num_groups
    longest_context = 0
    allocate = kv.allocate_slots

    def checked_allocate(req, num_new, hits=()):
        nonlocal longest_context
        new = allocate(req, num_new, hits)
        if new is not None:
            start = req.num_computed_tokens + len(hits) * block
            longest_context = max(longest_context, start + num_new)
            for group, (held, group_window) in enumerate(zip(kv.num_held_blocks(req.request_id), kv.group_windows)):
                most_held[group] = max(most_held[group], held)
                if group_window is not None:  # the chunk's keys span window - 1 + num_new positions
                    assert held <= -(-(window - 1 + num_new) // block) + 1
                    if num_new == 1:
                        assert held <= window // block + 2
        return new

    kv.allocate_slots = checked_allocate
    prompts = long_prompts(smollm2_tokenizer)
    assert min(len(p) for p in prompts) >= 3 * window
    max_tokens = [40, 30, 36, 24]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = hf_model(directory)
    expected = [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    for out, want in zip(outputs, expected):
        assert out.outputs[0].token_ids == want
    assert longest_context >= 6 * window
    assert core.scheduler.num_preemptions > 0
    assert outputs[1].num_cached_tokens > 0 or outputs[0].num_cached_tokens > 0
    for held, group_window in zip(most_held, kv.group_windows):
        if group_window is None:
            assert held >= longest_context // block  # global layers keep every block
    # A conversation continued: by its end its early blocks were dropped (and, in this small pool, evicted),
    # but a hit needs only the last window's blocks of a windowed group (and a global group's whole prefix).
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)[0]
    assert first.outputs[0].token_ids == expected[0]
    follow_up = prompts[0] + first.outputs[0].token_ids
    again = llm.generate([{"prompt_token_ids": follow_up}], SamplingParams(temperature=0.0, max_tokens=8,
                                                                          ignore_eos=True), use_tqdm=False)[0]
    assert again.num_cached_tokens >= 3 * window
    assert again.outputs[0].token_ids == hf_greedy(hf, follow_up, 8)
    assert kv.usage == 0.0


@pytest.mark.parametrize("family", WINDOW_FAMILIES)
def test_windowed_decodes_through_the_cpu_prefill_kernel_match_hf(kernels, window_dirs, smollm2_tokenizer, family):
    """Blocks of 8 tokens (the C++ prefill kernel's multiple): decodes past the 12-token window run as one-token
    chunks through that kernel, which applies the window; greedy tokens equal HF's."""
    directory = window_dirs[family]
    llm = LLM(str(directory), device="cpu", block_size=8, max_num_batched_tokens=32, max_model_len=128,
              num_kv_blocks=120, attention_backend="cpu", numerics="exact")
    prompts = long_prompts(smollm2_tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = hf_model(directory)
    assert [out.outputs[0].token_ids for out in outputs] == [hf_greedy(hf, p, 24) for p in prompts]


def random_workload(rng, tokenizer, max_model_len: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """3-9 greedy requests, most behind one shared system prompt, some sampled n = 2 or 3 times (forks)."""
    pieces = [tokenizer.encode(p) for p in GOLDEN_PROMPTS]
    system = rng.choice(pieces) + rng.choice(pieces)
    prompts, params = [], []
    for _ in range(rng.randint(3, 9)):
        ids = (system if rng.random() < 0.6 else []) + rng.choice(pieces) + rng.choice(pieces)[:rng.randint(1, 12)]
        prompts.append(ids[:min(100, max_model_len - 31)])
        params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30), ignore_eos=True,
                                     n=rng.choice([1, 1, 1, 2, 3])))
    return prompts, params


# Seeds whose workloads once broke parity: one KV cache group's new block was another group's prefix hit.
@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 8, 11])
def test_random_workloads_on_sliding_window_groups_match_hf(request, family_dirs, smollm2_tokenizer, seed):
    """Random block sizes, step budgets, mixed-step caps and pool sizes under a random workload served twice
    (the second time largely from the prefix cache): every sample's greedy tokens equal HF's."""
    import random

    rng = random.Random(seed)
    block_size, budget = rng.choice([4, 8, 16]), rng.choice([8, 16, 24, 48])
    mixed_cap, num_blocks = rng.choice([None, 1, 3, 8, budget]), rng.choice([60, 90, 120, 200])
    backend = rng.choice(["torch", "cpu"])
    if backend == "cpu":
        request.getfixturevalue("kernels")
    directory = family_dirs["gemma3"]
    llm = LLM(str(directory), device="cpu", block_size=block_size, max_num_batched_tokens=budget, max_model_len=160,
              num_kv_blocks=num_blocks, attention_backend=backend, max_mixed_prefill_tokens=mixed_cap, numerics="exact")
    prompts, params = random_workload(rng, smollm2_tokenizer, llm.llm_engine.max_model_len)
    hf = hf_model(directory)
    expected = [hf_greedy(hf, ids, p.max_tokens) for ids, p in zip(prompts, params)]
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        for out, want, p in zip(outputs, expected, params):
            assert len(out.outputs) == p.n
            assert all(sample.token_ids == want for sample in out.outputs)
    assert sum(out.num_cached_tokens for out in outputs) > 0
    assert llm.llm_engine.core.core.kv_cache.usage == 0.0


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_block_matches_hf(norm_topk_prob):
    """The grouped experts (each run once over its sorted tokens) give transformers' sparse block's
    output: the same top-k, weights and per-token sums."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from tokenmill.model.layers.moe import SparseMoeBlock, expert_destination

    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=3,
                            norm_topk_prob=norm_topk_prob)
    torch.manual_seed(1)
    hf = Qwen3MoeSparseMoeBlock(config).eval()
    ours = SparseMoeBlock(32, 16, 6, 3, norm_topk_prob, "silu")
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn_like(param))
        ours.gate.weight.copy_(hf.gate.weight)
        for e in range(6):  # per-expert checkpoint names, as HF checkpoints store them
            gate_up = hf.experts.gate_up_proj[e]
            for part, rows in (("gate_proj", gate_up[:16]), ("up_proj", gate_up[16:]),
                               ("down_proj", hf.experts.down_proj[e])):
                target, index = expert_destination(f"layers.0.mlp.experts.{e}.{part}.weight", 16)
                ours.get_parameter(target.removeprefix("layers.0.mlp."))[index].copy_(rows)
    x = torch.randn(11, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x.unsqueeze(0)).squeeze(0), atol=1e-5, rtol=1e-5)


def test_longrope_uses_long_factors_past_the_original_context():
    from transformers import Phi3Config

    from tokenmill.model.layers.basic import RotaryEmbedding

    rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                short_factor=[1.0, 2.0, 3.0, 4.0], long_factor=[5.0, 6.0, 7.0, 8.0])
    config = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                        original_max_position_embeddings=16, rope_parameters=rope)
    table = RotaryEmbedding(config, 16, 64, torch.device("cpu"))
    assert table.rotary_dim == 8 and table.cos.shape == (64, 8)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    attention_factor = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(16.0))).sqrt()
    for position, factors in ((15, rope["short_factor"]), (16, rope["long_factor"]), (63, rope["long_factor"])):
        angles = position * inv_freq / torch.tensor(factors)
        expected = torch.cat([angles, angles]).cos() * attention_factor
        torch.testing.assert_close(table.cos[position], expected)


def test_too_few_blocks_for_the_windowed_groups_is_a_load_error(family_dirs):
    """Gemma 3's five windowed groups need ~66 blocks each for 1,024-token chunks: 8 blocks cannot hold
    one request, and the engine says so at load instead of serving a context of zero tokens."""
    from tokenmill.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="cannot hold one request"):
        LLM(str(family_dirs["gemma3"]), device="cpu", num_kv_blocks=8, max_num_batched_tokens=1024)


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "qwen3"])
def test_fused_decode_stack_is_bit_identical_to_the_layers(kernels, family_dirs, smollm2_tokenizer, family):
    """The one-call decode stack implements each family's layer (Gemma 3: q/k norms, sandwich norms, GELU,
    local layers of a 12-token window in their own KV cache groups with their own rotary table; Gemma 2:
    soft-capped scores; Qwen3: q/k norms): a decode step of three requests, past the window, gives the same
    hidden states and cache writes as the per-layer modules, under int8 dot products and a 16-bit cache."""
    llm = LLM(str(family_dirs[family]), device="cpu", num_kv_blocks=64, max_model_len=192, quantization="q8_0",
              max_num_batched_tokens=64, dtype="float32", block_matmul="int8", kv_cache_dtype="bfloat16")
    model = llm.llm_engine.core.core.runner.model
    assert model._int8_decode is not None
    step = decode_step_both_ways(llm, [smollm2_tokenizer.encode(p) for p in GOLDEN_PROMPTS[:3]], max_tokens=20)
    assert step.fused_calls >= 15
    metas = step.metas
    assert metas[0].num_decodes == 3 and int(metas[0].decode_context_lens.min()) > 12  # past the window
    assert (family != "qwen3") == (len({id(meta) for meta in metas}) > 1)  # KV cache groups of local and global layers
    assert torch.equal(step.fused_hidden, step.layered_hidden)
    assert all(torch.equal(a, b) for a, b in zip(step.fused_caches, step.layered_caches))


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_fused_stack_runs_mixed_steps_bit_identical_to_the_layers(kernels, family_dirs, smollm2_tokenizer, family):
    """A mixed step (decode rows, then prefill chunks) runs through the one-call stack too when every chunk takes a
    C++ prefill kernel: here the float32 one (heads of 16), with Gemma 3's local layers' chunks windowed and
    Gemma 2's scores soft-capped. Same hidden states and cache writes as the per-layer modules. (SmolLM2's
    heads take the bfloat16 kernel: tests/model/test_q8_0.py.)"""
    llm = LLM(str(family_dirs[family]), device="cpu", num_kv_blocks=64, max_model_len=192, quantization="q8_0",
              max_num_batched_tokens=32, max_num_seqs=3, dtype="float32", block_matmul="int8",
              kv_cache_dtype="bfloat16", enable_prefix_caching=False)
    prompts = [smollm2_tokenizer.encode(p) for p in GOLDEN_PROMPTS[:5]]
    step = decode_step_both_ways(llm, prompts, max_tokens=12, mixed=True)
    meta = step.metas[0]
    assert 0 < meta.num_decodes < step.args[0].numel() and meta.prefill_query_ranges and step.fused_ran
    attn = llm.llm_engine.core.core.runner.model.layers[0].self_attn
    assert attn.backend.stack_prefill_tables(meta, attn.head_dim, attn.softcap)[1] is False  # the float32 kernel
    if family == "gemma3":  # KV cache groups of local and global layers; the chunks reach past the window
        assert len({id(meta) for meta in step.metas}) > 1 and max(meta.prefill_context_lens) > 12
    assert torch.equal(step.fused_hidden, step.layered_hidden)
    assert all(torch.equal(a, b) for a, b in zip(step.fused_caches, step.layered_caches))
