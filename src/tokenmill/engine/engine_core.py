"""The step loop: schedule -> execute -> update, owning the scheduler, KV cache and model runner."""
from __future__ import annotations

import logging
from typing import Iterable

import torch

from tokenmill.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, default_max_num_batched_tokens
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from tokenmill.engine.messages import EngineCoreOutput
from tokenmill.errors import ModelLoadError
from tokenmill.runner.model_runner import ModelRunner, resolve_device
from tokenmill.spec_decode.ngram import NgramProposer, can_speculate

logger = logging.getLogger("tokenmill")


def derive_max_model_len(config: EngineConfig, hf_config) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
    window = getattr(hf_config, "sliding_window", None)
    if window:
        # Without a sliding-window kernel, attention is exact only while contexts fit the window.
        model_max = min(model_max, window)
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ModelLoadError(f"max_model_len {config.max_model_len} exceeds the model's limit of {model_max} tokens")
    return config.max_model_len


class EngineCore:
    def __init__(self, config: EngineConfig, source) -> None:
        self.config = config
        hf_config = source.hf_config
        device = resolve_device(config.device)
        budget_was_defaulted = config.max_num_batched_tokens is None
        if budget_was_defaulted:
            config.max_num_batched_tokens = default_max_num_batched_tokens(device.type)
        max_model_len = derive_max_model_len(config, hf_config)
        self.runner = ModelRunner(hf_config, source.architecture, config.dtype, device, max_model_len,
                                  config.block_size, config.seed, config.num_threads,
                                  config.attention_backend,
                                  packed_linear_rows=min(config.max_num_seqs, 256) if config.packed_linear else None,
                                  quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype,
                                  structured_outputs_fast_forward=config.structured_outputs_fast_forward)
        int8_blocks = {} if self.runner.keeps_int8_blocks(source.is_gguf) else None
        self.runner.load_weights(source.iter_weights(self.runner.dtype, int8_blocks), int8_blocks)
        num_blocks = self._num_kv_blocks(device)
        self.runner.initialize_kv_cache(num_blocks)
        # A request must fit in the cache on its own, or preemption could never make room for it.
        self.max_model_len = min(max_model_len, num_blocks * config.block_size)
        self.runner.max_model_len = self.max_model_len
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            # Without chunking a prompt must fit one step, or a long one would wait forever.
            if budget_was_defaulted:
                config.max_num_batched_tokens = self.max_model_len
            else:
                raise ModelLoadError(
                    f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than max_model_len "
                    f"({self.max_model_len}) with chunked prefill disabled: raise --max-num-batched-tokens, lower "
                    "--max-model-len or enable chunked prefill")
        preemption_mode = config.preemption_mode or ("swap" if config.swap_space > 0 and device.type != "cpu"
                                                     else "recompute")
        num_host_blocks = 0
        if preemption_mode == "swap":
            num_host_blocks = int(config.swap_space * 2**30) // self.runner.kv_spec.bytes_per_block
            if num_host_blocks < 1:
                raise ModelLoadError("--swap-space must hold at least one KV block for swap preemption")
            self.runner.initialize_host_cache(num_host_blocks)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                policy=config.scheduling_policy,
                lpm_max_wait_s=config.lpm_max_wait,
                max_preemptions=config.max_preemptions,
                max_queue_time_s=config.max_queue_time,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                max_long_partial_prefills=config.max_long_partial_prefills,
                preemption_mode=preemption_mode,
            ),
            self.kv_cache,
        )
        spec = config.speculative_config
        self.proposer = NgramProposer(spec) if spec is not None else None
        if spec is not None:
            logger.info("speculative decoding: %s, %d tokens per step (n-grams of %d..%d)", spec.method,
                        spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        tokens = num_blocks * config.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB), max concurrency %.2fx at max_model_len=%d",
            num_blocks, config.block_size, tokens, num_blocks * self.runner.kv_spec.bytes_per_block / 2**20,
            tokens / self.max_model_len, self.max_model_len)

    def _num_kv_blocks(self, device: torch.device) -> int:
        spec = self.runner.kv_spec
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_memory_bytes is not None:
            budget = self.config.kv_cache_memory_bytes
        elif device.type == "cuda":
            budget = self.runner.profile_free_memory(self.config.max_num_batched_tokens,
                                                     self.config.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = spec.num_blocks_for(budget)
        if num_blocks < 1:
            raise ModelLoadError(f"the KV cache budget of {budget} bytes holds no block "
                                 f"({spec.bytes_per_block} bytes each)")
        return num_blocks

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str]) -> None:
        """Stop requests that the detokenizer saw hit a stop string."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def _propose_drafts(self, sched) -> None:
        """Drafts for every request this step brought up to date, verified by its next decode."""
        for item in sched.scheduled:
            request = item.request
            if (not request.is_finished and request.num_computed_tokens == request.num_tokens - 1
                    and can_speculate(request)):
                request.spec_token_ids = self.proposer.propose(request.all_token_ids)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)  # an empty schedule costs nothing in the runner
        # Fast-forwarded and speculating requests get several tokens this step: remember where their
        # new ones start.
        outputs_before = {item.request_id: item.request.num_output_tokens for item in sched.scheduled
                          if item.request_id in result.forced or item.request_id in result.accepted}
        finished_requests = self.scheduler.update_from_output(sched, result.sampled, result.forced,
                                                              result.accepted)
        if self.proposer is not None:
            self._propose_drafts(sched)
        finished = {r.request_id for r in finished_requests}
        scheduled_ids = {item.request_id for item in sched.scheduled}
        # Requests that ended without running this step (queue timeouts) still report their end.
        outputs = [EngineCoreOutput(request_id=r.request_id, finish_reason=r.status.finish_reason,
                                    stop_reason=r.stop_reason)
                   for r in finished_requests if r.request_id not in scheduled_ids]
        for item in sched.scheduled:
            request = item.request
            rid = request.request_id
            token = result.sampled.get(rid)
            prompt_lps = result.prompt_logprobs.get(rid)
            if token is None and prompt_lps is None:
                continue
            new_token_ids = [] if token is None else [token]
            if token is not None and rid in outputs_before:  # kept drafts, the sampled token, forced ones
                new_token_ids = request.output_token_ids[outputs_before[rid]:]
            out = EngineCoreOutput(
                request_id=rid,
                new_token_ids=new_token_ids,
                new_logprobs=[result.logprobs[rid]] if rid in result.logprobs else None,
                prompt_logprobs=prompt_lps,
                num_cached_tokens=request.num_cached_tokens or 0,
                num_preemptions=request.num_preemptions,
                first_scheduled_time=request.first_scheduled_time,
            )
            if rid in finished:
                out.finish_reason = request.status.finish_reason
                out.stop_reason = request.stop_reason
            outputs.append(out)
        return outputs
