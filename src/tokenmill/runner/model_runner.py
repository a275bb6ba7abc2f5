"""Runs one engine step on the device: SchedulerOutput -> tensors -> model -> sampled tokens."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from tokenmill.config import DEFAULT_CPU_KV_CACHE_BYTES, usable_cpu_count
from tokenmill.core.kv_cache_groups import plan_kv_cache_groups
from tokenmill.core.sched_output import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from tokenmill.distributed.parallel_state import TensorParallelGroup
from tokenmill.errors import ModelLoadError
from tokenmill.model.gguf_loader import Q8_0Rounding
from tokenmill.model.layers.attention import TorchAttentionBackend, get_attention_backend
from tokenmill.model.layers.basic import keep_rotary_tables_float, use_cpu_kernels
from tokenmill.model.layers.decoder import DecoderAttention
from tokenmill.model.layers.linear import Int8Blocks, skip_weight_init
from tokenmill.model.layers.linear_method import LinearMethods
from tokenmill.model.layers.parallel import fused_qkv_rows, shard_int8_blocks, shard_weights
from tokenmill.model.registry import get_model_class
from tokenmill.runner.backend_check import attention_mismatch
from tokenmill.runner.devices import choose_device
from tokenmill.runner.draft_verify import verify_drafts
from tokenmill.runner.host_memory import MemoryReport, process_rss_bytes, release_freed_memory
from tokenmill.runner.input_batch import InputBatch
from tokenmill.runner.kv_cache import (
    KVCacheSpec,
    allocate_kv_caches,
    copy_blocks,
    kv_blocks_in,
    kv_blocks_out,
    swap_blocks,
)
from tokenmill.runner.lora_slots import LoRASlots
from tokenmill.runner.model_memory import model_tensor_bytes
from tokenmill.sample.sampler import Sampler, compute_prompt_logprobs

logger = logging.getLogger("tokenmill")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {**DTYPES, "int8": torch.int8}


def resolve_device(name: Optional[str]) -> torch.device:
    """The device `--device name` runs on (None: CUDA where torch can use it, else the CPU); an explicit CUDA
    device torch cannot use is refused with the cause (runner/devices.py)."""
    return choose_device(name)[0]


# Tokens in the CPU warm-up step: above BLOCK_KERNEL_MAX_ROWS, so the prefill-sized matmul paths run too.
WARM_UP_TOKENS = 256


class ModelRunner:
    def __init__(self, config, hf_config, architecture: str, device: torch.device, max_model_len: int,
                 tp: Optional[TensorParallelGroup] = None) -> None:
        """config: the engine's EngineConfig with its device defaults (with_resolved_defaults) and numerics
        (runner.numerics: no `auto` dtype, block matmul or KV cache dtype) resolved.
        tp: this runner's tensor-parallel rank (runner/worker.py); it then holds the rank's shard of the
        model and KV cache, and only the driver rank samples."""
        self.tp = tp if tp is not None and tp.size > 1 else None
        num_threads = config.num_threads
        if device.type == "cpu":
            torch.set_num_threads(num_threads or usable_cpu_count())
        self.device = device
        dtype, block_size = config.dtype, config.block_size
        self.dtype = DTYPES[dtype]  # resolved from the hardware before the runner is built (runner.numerics)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.hf_config = hf_config
        model_class = get_model_class(architecture)
        self.attention_backend = get_attention_backend(device, config.attention_backend,
                                                       KV_CACHE_DTYPES[config.kv_cache_dtype],
                                                       config.block_matmul in ("bfloat16", "bfloat16-int8"))
        logger.info("attention backend: %s", self.attention_backend.describe())
        # Parameters are allocated but not initialized: the checkpoint overwrites them, and those a GGUF's
        # kept blocks replace are dropped with their pages never written (never resident).
        with torch.device(device), skip_weight_init():
            self.model = model_class(hf_config, self.attention_backend, max_model_len, device,
                                     **({} if self.tp is None else {"tp": self.tp}))
        self.model.to(dtype=self.dtype)
        keep_rotary_tables_float(self.model)
        self.model.eval().requires_grad_(False)
        if config.attention_backend == "auto" and self.attention_backend.name == "triton":
            self._check_attention_kernels()
        kernels = self.attention_backend.kernels
        if kernels is not None:
            # The backend runs on tokenmill's C++ CPU kernels: norms, rotary and activation use them too.
            use_cpu_kernels(self.model, kernels)
        attn = self.model.layers[0].self_attn
        cache_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype]
        # Layers with the same sliding window share a block table (core.kv_cache_groups); a block holds the
        # K/V of one group's layers, kept in layers_per_group tensors that every group shares.
        self.kv_layout = plan_kv_cache_groups(self.model.spec.layer_windows)
        self._layer_group = self.kv_layout.layer_group()
        self._layer_tensor = self.kv_layout.layer_tensor()
        if len(self.kv_layout.groups) > 1:
            logger.info("KV cache groups: %d of %d layers (windows %s)", len(self.kv_layout.groups),
                        self.kv_layout.layers_per_group, ", ".join(str(w) for w in self.kv_layout.windows))
        self.kv_spec = KVCacheSpec(self.kv_layout.layers_per_group, block_size, attn.num_kv_heads, attn.head_dim,
                                   cache_dtype)
        self.kv_caches: list[torch.Tensor] = []  # one per layer of a group (shared by the groups)
        self.layer_kv_caches: list[torch.Tensor] = []  # one per model layer: its group's tensor
        self.host_caches: list[torch.Tensor] = []
        self.sampler = Sampler(config.seed, kernels)
        self.input_batch = InputBatch(max_model_len, block_size, len(self.kv_layout.groups), config.max_num_seqs)
        self.packed_linear_rows = min(config.max_num_seqs, 256) if config.packed_linear else None
        # Each linear layer's method is chosen once, by the model's LinearMethods, when the weights are in.
        self.linear_methods = LinearMethods(self.model, kernels, device, self.dtype, config.quantization,
                                            config.block_matmul, self.packed_linear_rows, self.tp)
        self.linear_layers = ""  # how the projections run, once loaded (logged; reported by benchmarks)
        self.lora: Optional[LoRASlots] = None  # --enable-lora: the adapters' slots, added once the weights are in
        self._lora_slots = LoRASlots.settings(config)
        # Speculative decoding with a draft model: loaded after the target, on the rank that samples.
        spec = config.speculative_config
        self._draft_config = config if spec is not None and spec.uses_draft_model and (
            self.tp is None or self.tp.is_driver) else None
        self.drafter = None

    def _check_attention_kernels(self) -> None:
        """The triton kernels on this model's attention shapes, once per distinct (window, soft-cap) kind of
        layer; the torch backend takes over where they fail to compile or disagree with it."""
        layers = [module for module in self.model.modules() if isinstance(module, DecoderAttention)]
        for attention in {(layer.window, layer.softcap): layer for layer in layers}.values():
            problem = attention_mismatch(self.attention_backend, attention, self.dtype, self.device)
            if problem is not None:
                logger.warning("the %s attention kernels failed their start-up check on this model (%s); "
                               "using the torch backend", self.attention_backend.name, problem)
                self.attention_backend = TorchAttentionBackend()
                for layer in layers:
                    layer.backend = self.attention_backend
                return

    def load_checkpoint(self, source, draft_source=None) -> None:
        """Streams `source`'s weights into the model. A GGUF's block-quantized matrices are kept as stored
        where this runner multiplies them so (`keeps_int8_blocks`), without a float copy, and so are matrices
        `--quantization q8_0` rounds as they arrive (`round_while_loading`); a tensor-parallel
        rank reads their float values too, for a shard whose inputs do not fall on 32-value blocks.
        draft_source: with a draft model (speculative decoding), its source, loaded on the rank that samples."""
        rounds = self.linear_methods.rounds_at_load(source.is_gguf)
        int8_blocks = self.linear_methods.block_store() if rounds or self.linear_methods.keeps_int8_blocks(
            source.is_gguf) else None
        # A GGUF's matrices in types not kept (Q6_K, F16) are rounded by its reader, a run of rows at a time.
        rounding = Q8_0Rounding(self.linear_methods.matrix_names, self.linear_methods.rounded_at_load) \
            if rounds and self.tp is None else None
        weights = source.iter_weights(self.dtype, int8_blocks, dense_kept=self.tp is not None, rounding=rounding,
                                      kernels=self.linear_methods.kernels, stored_dtype=rounds)
        if rounds:  # Q8_0 rounding (--quantization q8_0, a GGUF's Q6_K/F16 matrices): as each arrives, no float copy
            weights = self.linear_methods.round_while_loading(weights, int8_blocks)
        self.load_weights(weights, int8_blocks)
        if self._draft_config is not None:
            from tokenmill.runner.drafter import Drafter

            self.drafter = Drafter(self._draft_config, draft_source, self)

    def load_weights(self, weights, int8_blocks: Optional[dict[str, Int8Blocks]] = None) -> None:
        """Copies `weights` into the model, then builds its linear layers; `int8_blocks` (filled while
        `weights` is consumed) holds the checkpoint matrices to keep in block-int8 form."""
        if self.tp is None:
            self.model.load_weights(weights, skip=int8_blocks if int8_blocks is not None else ())
        else:  # every rank's shard is filled: its kept blocks are sliced after loading
            qkv_rows = fused_qkv_rows(self.model.spec, self.tp.size)
            self.model.load_weights(shard_weights(weights, self.tp, qkv_rows))
            if int8_blocks:
                shard_int8_blocks(int8_blocks, self.tp, qkv_rows)
        self.linear_layers = self.linear_methods.apply(int8_blocks)
        logger.info("linear layers: %s", self.linear_layers)
        self.lora = LoRASlots(self.model, *self._lora_slots, tp=self.tp, kernels=self.attention_backend.kernels) \
            if self._lora_slots else None

    # What the linear layers' methods decided (tests and benchmark reports read these off the runner).
    @property
    def block_kernels(self):
        return self.linear_methods.block_kernels

    @property
    def packed_linear(self) -> bool:
        return self.linear_methods.packed_linear

    @property
    def num_gguf_layers_kept(self) -> int:
        return self.linear_methods.num_gguf_layers_kept

    def kv_cache_capacity(self, config) -> int:
        """The KV blocks this runner holds: --num-kv-blocks, or what its memory budget fits (under tensor
        parallelism a block holds this rank's KV heads only, and the budget is each worker's)."""
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory_bytes is not None:
            budget = config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self.profile_free_memory(config.max_num_batched_tokens, config.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        # A draft model's KV cache has a block for each of the target's: the budget holds both.
        bytes_per_block = self.kv_spec.bytes_per_block + (self.drafter.bytes_per_block if self.drafter else 0)
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ModelLoadError(f"the KV cache budget of {budget} bytes holds no block "
                                 f"({bytes_per_block} bytes each)")
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)
        self.layer_kv_caches = [self.kv_caches[j] for j in self._layer_tensor]
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks)

    def profile_free_memory(self, max_num_batched_tokens: int, utilization: float) -> int:
        """CUDA: bytes left for the KV cache after weights and a peak-size forward pass.

        As in vLLM, `utilization` is this engine's share of the whole device: memory that other
        processes (or other engines in this process) already hold counts against it, so a second
        engine on a shared GPU gets a clear error instead of an out-of-memory crash mid-serving.
        """
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        held_elsewhere = max(0, total - free - torch.cuda.memory_reserved(self.device))
        available = total - held_elsewhere  # free, plus what this process's allocator already holds
        if available < total * utilization:
            raise ModelLoadError(
                f"only {available / 2**30:.1f} GiB of the GPU's {total / 2**30:.1f} GiB are available, less than "
                f"--gpu-memory-utilization {utilization} asks for; lower it, or free the GPU")
        torch.cuda.reset_peak_memory_stats(self.device)
        self.initialize_kv_cache(1)
        self._dummy_step(max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = self.layer_kv_caches = []
        torch.cuda.empty_cache()
        return max(0, int(total * utilization) - peak - held_elsewhere)

    def _dummy_step(self, max_num_batched_tokens: int) -> None:
        """One step of a dummy request of max_num_batched_tokens tokens (the largest the scheduler forms),
        every slot in block 0 (rewritten before any request reads it)."""
        from tokenmill.sampling_params import SamplingParams

        num_tokens = min(max_num_batched_tokens, self.max_model_len)
        blocks = [0] * (-(-num_tokens // self.block_size))
        more = [blocks] * (len(self.kv_layout.groups) - 1)
        self.execute(SchedulerOutput(
            new_requests=[NewRequestData("warm-up", [0] * num_tokens, SamplingParams(max_tokens=1))],
            scheduled=[ScheduledRequest("warm-up", 0, num_tokens, [0] * num_tokens, blocks, samples=True,
                                        more_group_block_ids=more)]))
        self.execute(SchedulerOutput(finished_ids=["warm-up"]))

    def warm_up(self, max_num_batched_tokens: int) -> MemoryReport:
        """After the KV cache is allocated: memory freed by loading goes back to the OS, then a warm-up step
        measures what a step's activations add (on CPU, where the allocator hands pages back and forth with
        the OS; on accelerators the profile run sized the cache already). The step is of at most
        WARM_UP_TOKENS tokens: it runs every kernel a step runs, threads and buffers included, while a step
        of the whole budget is a full prefill's compute (seconds at 1B, tens of seconds at 8B) for a few
        percent more of the process's memory (measured: docs/benchmarks.md)."""
        release_freed_memory()
        before = process_rss_bytes()
        tokens = min(max_num_batched_tokens, WARM_UP_TOKENS, self.max_model_len) if self.device.type == "cpu" else 0
        if tokens:
            self._dummy_step(tokens)
        after = process_rss_bytes()
        activations = max(0, after - before) if before is not None and after is not None else 0
        kv_bytes = sum(t.numel() * t.element_size() for t in self.kv_caches)
        weights, buffers = model_tensor_bytes(self.model)
        if self.drafter is not None:  # the draft model's memory counts with the target's
            draft = self.drafter.runner.warm_up(max_num_batched_tokens)
            weights, buffers, kv_bytes = weights + draft.weights, buffers + draft.buffers, kv_bytes + draft.kv_cache
            activations, after = activations + draft.activations, draft.rss
        return MemoryReport(weights=weights, buffers=buffers, kv_cache=kv_bytes, activations=activations, rss=after,
                            warm_up_tokens=tokens)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        result = self._execute(output)
        if self.drafter is not None:
            self.drafter.propose(output, self.input_batch, result)
        if output.kv_stores:  # the blocks this forward pass filled, for the prefix cache's second tier
            result.kv_stored = kv_blocks_out(self.kv_caches, output.kv_stores, self.tp)
        return result

    def _execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput(sampled={}, logprobs={}, prompt_logprobs={}, accepted={})
        states = self.input_batch.update(output)
        swap_blocks(self.kv_caches, self.host_caches, output.swap_out, output.swap_in, self.device)
        copy_blocks(self.kv_caches, output.block_copies, self.device)
        if output.kv_loads:
            kv_blocks_in(self.kv_caches, output.kv_loads, self.kv_spec, self.tp.rank if self.tp is not None else 0)
        if self.lora is not None:
            self.lora.track(output)
        if not output.scheduled:
            return result
        batch = self.input_batch
        backend = self.attention_backend
        inputs = batch.prepare(output.scheduled, states, self.device, backend.paged_decode)
        if self.lora is not None:
            self.lora.prepare(output.scheduled, states, inputs.token_rows)
        metas = [backend.prepare_metadata(group_inputs) for group_inputs in inputs.attention]
        # Several KV cache groups: each layer attends through its group's tables.
        meta = metas[0] if len(metas) == 1 else [metas[group] for group in self._layer_group]
        hidden = self.model(inputs.input_ids, inputs.positions, self.layer_kv_caches, meta)

        # Rows the sampler picks a token for, their items and states (in the same order), and the
        # speculative verifies, which take the argmax at each draft position instead.
        sampling_rows, sampled_items, sampler_states, batch_rows, verifying = [], [], [], [], []
        grammar_rows = output.grammar_rows
        for item, state, last in zip(output.scheduled, states, inputs.last_token_index):
            params = state.sampling_params
            if params.prompt_logprobs is not None:
                self._prompt_logprobs(item, state, hidden, last, result)
            if item.samples and item.spec_token_ids:
                verifying.append((item, state, last))
            elif item.samples:
                sampling_rows.append(last)
                sampled_items.append(item)
                known_end = item.start_position + item.num_new_tokens
                batch_rows.append(state.row)
                sampler_states.append(batch.sampling_state(state, known_end, grammar_rows.get(item.request_id)))
        if verifying:
            self._verify_drafts(verifying, hidden, result, output)
        if not sampler_states:
            return result
        logits = self.model.compute_logits(hidden[sampling_rows])
        if self.tp is not None and not self.tp.is_driver:
            # Only the driver's samples reach the core; every rank's next tokens come from the core's
            # next SchedulerOutput, so the ranks' input batches agree without sampling here.
            return result
        sampler_out = self.sampler(logits, sampler_states, self._grammar_bitmask(output),
                                   batch.sampling_arrays(batch_rows))
        for item, token, logprobs in zip(sampled_items, sampler_out.sampled_token_ids, sampler_out.logprobs):
            result.sampled[item.request_id] = token
            if logprobs is not None:
                result.logprobs[item.request_id] = logprobs
        return result

    def _grammar_bitmask(self, output: SchedulerOutput) -> Optional[torch.Tensor]:
        if output.grammar_bitmask is None:
            return None
        words = (self.hf_config.vocab_size + 31) // 32
        return torch.frombuffer(bytearray(output.grammar_bitmask), dtype=torch.int32).view(-1, words)

    def _verify_drafts(self, verifying: list, hidden: torch.Tensor, result: ModelRunnerOutput,
                       output: SchedulerOutput) -> None:
        """Speculative decoding: the target's logits at every draft position (and the one after the
        last) decide which drafts are kept and the step's token (draft_verify.verify_drafts)."""
        rows: list[int] = []
        for item, _, last in verifying:
            rows.extend(range(last - len(item.spec_token_ids), last + 1))
        logits = self.model.compute_logits(hidden[rows])
        if self.tp is not None and not self.tp.is_driver:
            return  # the driver's tokens reach the core (as for sampled rows)
        verify_drafts(self.sampler, self.input_batch, logits, [(item, state) for item, state, _ in verifying], result,
                      output.grammar_rows, self._grammar_bitmask(output), self.drafter and self.drafter.draft_probs)

    def initialize_host_cache(self, num_blocks: int) -> None:
        """Swap space in host memory (pinned on CUDA, so copies can run at full bandwidth)."""
        pin = self.device.type == "cuda"
        self.host_caches = [cache.pin_memory() if pin else cache
                            for cache in allocate_kv_caches(self.kv_spec, num_blocks, torch.device("cpu"))]

    def _prompt_logprobs(self, item, state, hidden: torch.Tensor, last: int, result: ModelRunnerOutput) -> None:
        """Score the prompt tokens this chunk predicts: position p's logits score token p + 1."""
        start = item.start_position
        end = min(start + item.num_new_tokens, state.num_prompt_tokens - 1)
        if end <= start:
            return
        first_flat = last - item.num_new_tokens + 1
        logits = self.model.compute_logits(hidden[first_flat:first_flat + (end - start)])
        targets = state.prompt_token_ids[start + 1:end + 1]
        entries = compute_prompt_logprobs(logits, targets, state.sampling_params.prompt_logprobs)
        result.prompt_logprobs[item.request_id] = (start + 1, entries)
