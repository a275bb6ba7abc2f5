"""The engine core: scheduler, KV cache manager, structured-output grammars and the model runner,
stepped as schedule -> execute -> update. It talks to its frontend only through the plain-data
messages of `messages.py` (and to the runner through `core/sched_output.py`), so it can run in the
frontend's process (the offline LLM, tests) or in its own (`core_proc.py`, what the server uses).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import msgspec
import torch

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_groups import blocks_per_sequence
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import QUEUE_FULL, Scheduler
from tokenmill.core.scheduler_stats import SchedulerStats
from tokenmill.engine.draft_setup import resolve_draft
from tokenmill.engine.executor import make_executor
from tokenmill.engine.input_processor import eos_token_ids
from tokenmill.engine.kv_offload import open_kv_tier
from tokenmill.engine.messages import (
    EngineCoreAbort,
    EngineCoreFork,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    FrontendModelInfo,
    roundtrip,
)
from tokenmill.engine.tokenizer_handover import tokenizer_files
from tokenmill.errors import ModelLoadError, TokenmillError
from tokenmill.model.layers.lora import target_shapes
from tokenmill.model.loader import load_model_source
from tokenmill.model.registry import SLIDING_WINDOW_ARCHITECTURES, get_model_class
from tokenmill.runner.devices import choose_device
from tokenmill.runner.numerics import detect_hardware, has_experts, resolve_numerics
from tokenmill.spec_decode import adaptive
from tokenmill.spec_decode.ngram import NgramProposer, can_speculate
from tokenmill.structured.backend import AfterToken, allocate_token_bitmask
from tokenmill.structured.llguidance_backend import LLGuidanceBackend

logger = logging.getLogger("tokenmill")

# A step computing at least this many prompt tokens times the prefill rate the KV offload tier compares
# its reads against (decode-only steps would understate it).
MIN_PROMPT_TOKENS_TO_TIME = 64
SHUTDOWN_FLUSH_S = 10.0
# A draft model that rested for a request resumes only if the reply has at least 1/RESUME_CATCH_UP_RATIO of the
# request's tokens still to come (its catch-up computes them all).
RESUME_CATCH_UP_RATIO = 8


def derive_max_model_len(config: EngineConfig, hf_config) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:
        window = None  # Qwen2/3 configs carry a window they do not use
    architecture = (getattr(hf_config, "architectures", None) or [None])[0]
    if window and architecture not in SLIDING_WINDOW_ARCHITECTURES:
        # A family that cannot attend through a window is exact only while contexts fit it.
        model_max = min(model_max, window)
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ModelLoadError(f"max_model_len {config.max_model_len} exceeds the model's limit of {model_max} tokens")
    return config.max_model_len


def max_request_tokens(group_windows, num_blocks: int, block_size: int, max_chunk: int) -> int:
    """The longest context one request can hold alone in num_blocks blocks (core.kv_cache_groups): a
    full-attention group needs a block per block_size tokens; a sliding-window group at most the blocks
    that a chunk of up to max_chunk tokens and the window before it touch; windows take the null block."""
    windowed = [w for w in group_windows if w is not None]
    num_full = len(group_windows) - len(windowed)
    usable = num_blocks - (1 if windowed else 0) - sum(-(-(w - 1 + max_chunk) // block_size) + 1 for w in windowed)
    if usable < 0:
        return 0
    if num_full == 0:
        return 1 << 62  # a window's blocks are all a context of any length needs
    return usable // num_full * block_size


def check_tensor_parallel(config: EngineConfig, hf_config) -> None:
    """A clear error, before any worker starts, when the model's heads do not split over the ranks."""
    size = config.tensor_parallel_size
    if size == 1:
        return
    from tokenmill.model.layers.parallel import check_divisible

    heads = hf_config.num_attention_heads
    # Experts split by their features on every rank (model/layers/parallel.py).
    is_moe = bool(getattr(hf_config, "num_experts", None))
    moe_features = getattr(hf_config, "moe_intermediate_size", None) if is_moe else None
    try:
        check_divisible(heads, getattr(hf_config, "num_key_value_heads", None) or heads,
                        hf_config.intermediate_size, size, moe_features or 0)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


def _lora_targets(hf_config, architecture: str) -> dict[str, list[int]]:
    """What a LoRA adapter of this model may target: its family's projections, the experts' MLP excluded."""
    model_class = get_model_class(architecture)
    return target_shapes(hf_config, not model_class._FUSED,
                         sparse_mlp=any(model_class.build_spec(hf_config).layer_sparse))


class EngineCore:
    def __init__(self, config: EngineConfig, source=None, message_roundtrip: bool = False) -> None:
        """source: the loaded model source (loaded here when None). message_roundtrip: encode and decode
        every core <-> runner message, as a process boundary would (tests)."""
        self.message_roundtrip = message_roundtrip
        # The device first: one torch cannot use is refused before anything loads.
        device, self.device_reason = choose_device(config.device)
        if device.type == "cpu" and "NVIDIA driver" in self.device_reason:
            logger.warning("device: cpu (%s)", self.device_reason)
        source = source if source is not None else load_model_source(config.model, config.tokenizer)
        hf_config = source.hf_config
        self.device = device
        self.vocab_size = hf_config.vocab_size
        self.tokenizer = source.tokenizer
        # What a frontend needs of the model (the ready message carries it).
        self.model_info = FrontendModelInfo(served_model_name=source.served_model_name, vocab_size=self.vocab_size,
                                            eos_token_ids=eos_token_ids(source.tokenizer, hf_config),
                                            num_hidden_layers=hf_config.num_hidden_layers,
                                            lora_shapes=_lora_targets(hf_config, source.architecture))
        # Device- and model-dependent defaults resolved once, into a new config (the caller's is never written
        # to), before anything is built from it.
        budget_was_given = config.max_num_batched_tokens is not None
        max_model_len = derive_max_model_len(config, hf_config)
        config = config.with_resolved_defaults(device.type, max_model_len)
        hardware = detect_hardware(device.type, config.attention_backend)
        file_blocks = config.quantization in (None, "gguf") and source.has_int8_block_matrices()
        self.numerics = resolve_numerics(config, hardware, file_blocks, experts=has_experts(hf_config))
        logger.info("numerics on %s: %s", hardware.describe(), self.numerics.describe())
        config = self.numerics.apply(config)
        draft_source = None
        if config.speculative_config is not None and config.speculative_config.uses_draft_model:
            spec, draft_source = resolve_draft(config, source, hardware, self.numerics)
            config = dataclasses.replace(config, speculative_config=spec)
        check_tensor_parallel(config, hf_config)
        self.executor = make_executor(config, source, device, max_model_len, draft_source)
        # The in-process runner (tests and tools look at it); None when tensor-parallel workers hold the model.
        self.runner = getattr(self.executor, "runner", None)
        self.linear_layers = self.executor.linear_layers
        self.config = config
        num_blocks = self.executor.num_kv_blocks
        self.num_kv_blocks = num_blocks
        self.bytes_per_block = self.executor.bytes_per_block
        # A request must fit in the cache on its own, or preemption could never make room for it.
        self.max_model_len = min(max_model_len, max_request_tokens(
            self.executor.kv_windows, num_blocks, config.block_size,
            config.max_num_batched_tokens if config.enable_chunked_prefill else max_model_len))
        if self.max_model_len < 1:
            self.executor.shutdown()
            raise ModelLoadError(
                f"a KV cache of {num_blocks} blocks cannot hold one request: the sliding-window layer groups alone "
                f"need more for chunks of {config.max_num_batched_tokens} tokens; raise --num-kv-blocks (or the KV "
                "cache memory) or lower --max-num-batched-tokens")
        if budget_was_given and not config.enable_chunked_prefill and \
                config.max_num_batched_tokens < self.max_model_len:
            # Without chunking a prompt must fit one step, or a long one would wait forever.
            self.executor.shutdown()
            raise ModelLoadError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill disabled: raise --max-num-batched-tokens, lower "
                "--max-model-len or enable chunked prefill")
        num_host_blocks = 0
        if config.preemption_mode == "swap":
            num_host_blocks = int(config.swap_space * 2**30) // self.bytes_per_block
            if num_host_blocks < 1:
                self.executor.shutdown()
                raise ModelLoadError("--swap-space must hold at least one KV block for swap preemption")
        windows = self.executor.kv_windows
        if num_host_blocks and (len(windows) > 1 or windows[0] is not None):
            logger.info("sliding-window KV cache groups: preempted requests are recomputed, not swapped")
        self.executor.initialize_cache(num_blocks, num_host_blocks, self.max_model_len)
        try:
            self.kv_tier = open_kv_tier(config, source.path, self.bytes_per_block, device.type)
        except ModelLoadError:
            self.executor.shutdown()
            raise
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks,
                                       group_windows=windows, tier=self.kv_tier,
                                       max_pinned_blocks=int(num_blocks * config.kv_cache_pin_fraction))
        self.scheduler = Scheduler(config, self.max_model_len, self.kv_cache)
        # Structured outputs: grammars compiled against the tokenizer, masks sized to the model's logits.
        self.structured_backend = LLGuidanceBackend(source.tokenizer, self.vocab_size, self.model_info.eos_token_ids)
        spec = config.speculative_config
        # n-grams are proposed here; a draft model's drafts come back with the runner's output.
        self.proposer = NgramProposer(spec) if spec is not None and spec.method == "ngram" else None
        self.spec_step_draft_limit = 0  # the last step's decision: drafts a request may propose
        if spec is not None and spec.uses_draft_model:
            self.scheduler.draft_batch_limit = self._spec_batch_limit()
        if spec is not None:
            logger.info("speculative decoding: %s, %d tokens per step%s", spec.method, spec.num_speculative_tokens,
                        f" (n-grams of {spec.prompt_lookup_min}..{spec.prompt_lookup_max})" if self.proposer else "")
        # Answers decided outside a step (refusals), sent with the next step's outputs.
        self._pending: list[EngineCoreOutput] = []
        tokens = num_blocks * config.block_size
        # Sliding-window groups hold only their window's blocks of a request (core/kv_cache_groups.py).
        self.max_concurrency = num_blocks / blocks_per_sequence(self.executor.kv_windows, self.max_model_len,
                                                                config.block_size)
        logger.info(
            "KV cache (%s): %d blocks of %d tokens (%d tokens, %.1f MiB), max concurrency %.2fx at max_model_len=%d",
            config.kv_cache_dtype, num_blocks, config.block_size, tokens, num_blocks * self.bytes_per_block / 2**20,
            self.max_concurrency, self.max_model_len)
        self.memory = self.executor.warm_up(config.max_num_batched_tokens)
        logger.info("memory: %s", self.memory.describe())

    def shutdown(self) -> None:
        """Stops the model's worker processes (tensor parallelism), after the KV offload tier has written what
        it was handed (so a restart finds every block)."""
        if self.kv_tier is not None and not self.kv_tier.flush(timeout=SHUTDOWN_FLUSH_S):
            logger.warning("KV offload: blocks still unwritten after %.0f s at shutdown were dropped", SHUTDOWN_FLUSH_S)
        self.executor.shutdown()

    def ready_message(self, with_tokenizer: bool = False) -> EngineCoreReady:
        """with_tokenizer: the model info carries the tokenizer's files, for a frontend in another process
        (which then never loads the model); a frontend in this process takes the tokenizer object."""
        info = self.model_info
        if with_tokenizer:
            info = msgspec.structs.replace(info, tokenizer_files=tokenizer_files(self.tokenizer))
        return EngineCoreReady(max_model_len=self.max_model_len, num_kv_blocks=self.num_kv_blocks,
                               block_size=self.config.block_size, device=str(self.device),
                               linear_layers=self.linear_layers, weights_bytes=self.memory.weights,
                               buffers_bytes=self.memory.buffers, kv_cache_bytes=self.memory.kv_cache,
                               activations_bytes=self.memory.activations,
                               rss_bytes=self.memory.rss, numerics=self.numerics.as_dict(), model_info=info,
                               device_reason=self.device_reason,
                               config=self.resolved_options(),
                               kv_offload_root=str(self.kv_tier.root) if self.kv_tier is not None else None,
                               kv_offload_file_bytes=self.kv_tier.file_bytes if self.kv_tier is not None else 0)

    def resolved_options(self) -> dict[str, Any]:
        """The options the core runs with, as plain data (the model's path, not a secret; no API keys live here)."""
        options = dataclasses.asdict(self.config)
        options["max_model_len"] = self.max_model_len  # the effective limit, capped by the KV cache
        options["num_kv_blocks"] = self.num_kv_blocks
        return options

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, message: EngineCoreRequest) -> None:
        """Admit a request, or answer it at once (queue full, grammar that does not compile)."""
        rid = message.request_id
        limit = self.config.max_num_queued_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            self._pending.append(EngineCoreOutput(rid, finish_reason="abort", stop_reason=QUEUE_FULL))
            return
        if not message.prompt_token_ids:
            # Nothing to compute: the scheduler would never schedule it and it would wait forever.
            # The frontend refuses these already; a client of the core gets an answer too.
            self._pending.append(EngineCoreOutput(rid, finish_reason="abort", error="the prompt has no tokens"))
            return
        params = message.sampling_params
        children = message.fork_children
        try:
            grammars = [self._compile(params) for _ in range(len(children) if children else 1)]
        except TokenmillError as exc:
            self._pending.append(EngineCoreOutput(rid, finish_reason="abort", error=exc.message))
            return
        if not children:
            request = self._request(rid, message, params, grammars[0])
            spec = self.config.speculative_config
            if spec is not None and spec.uses_draft_model and can_speculate(request):
                # Its prompt's last chunk already drafts, unless that step's batch is too large for drafts to
                # pay (the scheduler's draft_batch_limit; then the draft model never computes its prompt).
                request.num_draft_lookahead = spec.num_speculative_tokens
            self.scheduler.add_request(request)
            return
        # The prompt is computed once by the parent; the samples fork from it and share its blocks,
        # copying the partially filled last block when they diverge.
        forks = [self._request(child.request_id, message,
                               params if child.seed is None else params.clone(seed=child.seed), grammar)
                 for child, grammar in zip(children, grammars)]
        parent = self._request(rid, message, params, None)
        parent.fork_children = forks
        self.scheduler.add_request(parent)

    def _compile(self, params):
        grammar = None if params.structured_outputs is None else \
            self.structured_backend.compile(params.structured_outputs)
        end = params.reasoning_end_token_id
        if end is None or (grammar is None and params.thinking_token_budget is None):
            return grammar
        return AfterToken(grammar, end, params.thinking_token_budget)

    @staticmethod
    def _request(request_id: str, message: EngineCoreRequest, params, grammar) -> Request:
        return Request(request_id, list(message.prompt_token_ids), params, message.eos_token_id,
                       arrival_time=message.arrival_time, priority=message.priority, user=message.user,
                       structured_output=grammar, park_after_sample=message.park_after_sample, lora=message.lora)

    def fork(self, message: EngineCoreFork) -> None:
        """Beam search: the picked beams continue from a parked parent (its blocks shared, its last
        sampled token replaced by each child's own)."""
        parent = self.scheduler.requests.get(message.parent_id)
        if parent is None or parent.is_finished or parent.fork_children != []:
            for child in message.children:
                self._pending.append(EngineCoreOutput(child.request_id, finish_reason="abort",
                                                      error=f"beam {message.parent_id} cannot be continued"))
            return
        forks = []
        for child in message.children:
            request = Request(child.request_id, parent.prompt_token_ids, parent.sampling_params,
                              parent.eos_token_id, arrival_time=parent.arrival_time, priority=parent.priority,
                              user=parent.user, park_after_sample=parent.park_after_sample)
            for token in parent.output_token_ids[:-1]:
                request.append_output_token(token)
            request.append_output_token(child.last_token_id)
            forks.append(request)
        parent.fork_children = forks  # the scheduler forks them at its next step

    def abort(self, message: EngineCoreAbort) -> None:
        status = RequestStatus.FINISHED_STOPPED if message.stopped else RequestStatus.FINISHED_ABORTED
        self.scheduler.finish_requests(message.request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def _spec_batch_limit(self):
        spec = self.config.speculative_config
        if spec.disable_by_batch_size is None and spec.adaptive:
            return adaptive.MAX_BATCH_DRAFT_MODEL if spec.uses_draft_model else adaptive.MAX_BATCH
        return spec.disable_by_batch_size

    def _propose_drafts(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Drafts for every request this step brought up to date, verified by its next decode; with the
        adaptive length, as many as the request's recent acceptance makes worth a verify row each. A draft
        model proposed its drafts in this step already (as many as the request's lookahead asked); the same
        decision sets how many it proposes in the next."""
        spec = self.config.speculative_config
        accepted = result.accepted
        step_limit = self.spec_step_draft_limit = adaptive.step_draft_limit(
            spec.num_speculative_tokens, len(self.scheduler.running), self._spec_batch_limit())
        for item in sched.scheduled:
            request = self.scheduler.step_request(item.request_id)
            if (request is None or request.is_finished or request.num_computed_tokens != request.num_tokens - 1
                    or not can_speculate(request)):
                continue
            if not step_limit:
                request.spec_token_ids = []
                request.draft_behind |= self.proposer is None and request.num_draft_lookahead > 0
                request.num_draft_lookahead = 0
                continue
            if request.draft_behind:
                # The draft model would first compute every token of the request: worth it only for a reply
                # with enough left to draft (a catch-up token costs about an eighth of a decode row).
                if (request.max_tokens - request.num_output_tokens) * RESUME_CATCH_UP_RATIO < request.num_tokens:
                    continue
                request.draft_behind = False
            max_drafts = step_limit
            if spec.adaptive:
                acceptance = adaptive.PRIOR if request.spec_acceptance is None else request.spec_acceptance
                if item.spec_token_ids:
                    acceptance = adaptive.after_verify(acceptance, len(item.spec_token_ids),
                                                       len(accepted.get(item.request_id) or ()))
                else:
                    acceptance = adaptive.after_idle_step(acceptance)
                request.spec_acceptance = acceptance
                max_drafts = adaptive.draft_length(max_drafts, acceptance)
            if self.proposer is None:
                drafts = result.drafts.get(item.request_id, [])[:max_drafts]
                request.num_draft_lookahead = max_drafts
            else:
                drafts = self.proposer.propose(request.all_token_ids)[:max_drafts] if max_drafts else []
            if drafts and request.structured_output is not None:  # only drafts the grammar allows
                drafts = drafts[:request.structured_output.valid_prefix(
                    drafts, stop_before_forced=self._fast_forwards(request))]
            request.spec_token_ids = drafts

    def _fill_grammar_bitmask(self, sched: SchedulerOutput) -> None:
        """Structured outputs: the tokens each constrained row may sample, computed here (the grammar
        state lives with the request) and sent to the runner as bytes."""
        constrained = []
        for item in sched.scheduled:
            if item.samples:
                request = self.scheduler.step_request(item.request_id)
                if request is not None and request.structured_output is not None:
                    constrained.append((item, request.structured_output))
        if not constrained:
            return
        # A speculative verify gets a row per position: the mask after each of its drafts in turn.
        bitmask = allocate_token_bitmask(sum(len(item.spec_token_ids) + 1 for item, _ in constrained), self.vocab_size)
        row = 0
        for item, grammar in constrained:
            if item.spec_token_ids:
                grammar.fill_bitmasks_along(bitmask, row, item.spec_token_ids)
            else:
                grammar.fill_bitmask(bitmask, row)
            sched.grammar_rows[item.request_id] = row
            row += len(item.spec_token_ids) + 1
        sched.grammar_bitmask = bitmask.numpy().tobytes()

    def _fast_forwards(self, request: Request) -> bool:
        """Whether text the request's grammar forces is appended without a model step per token (not for
        requests that want logprobs, which need a distribution for every token)."""
        return self.config.structured_outputs_fast_forward and request.sampling_params.logprobs is None

    def _advance_grammars(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> dict[str, list[int]]:
        """Feed sampled tokens to their grammars; returns the tokens each grammar now forces."""
        forced: dict[str, list[int]] = {}
        for request_id in sched.grammar_rows:
            token = result.sampled.get(request_id)
            request = self.scheduler.step_request(request_id)
            if token is None or request is None:
                continue
            grammar = request.structured_output
            for kept in result.accepted.get(request_id) or ():  # a verify's kept drafts come first
                grammar.accept_token(kept)
            grammar.accept_token(token)
            # Fast-forward: text the grammar now forces is appended without a model step per token.
            # Not for requests that want logprobs, which need a distribution for every token.
            if self._fast_forwards(request):
                tokens = grammar.forced_tokens()
                if tokens:
                    forced[request_id] = tokens
        return forced

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        outputs, self._pending = self._pending, []
        if self.scheduler.has_unfinished_requests():
            outputs.extend(self._step())
        stats = self.scheduler.get_stats()
        stats.spec_step_draft_limit = self.spec_step_draft_limit
        if self.device.type == "cuda" and self.runner is not None:
            # The API process holds no CUDA context: device memory is reported from here (tensor-parallel
            # workers hold theirs in their own processes; the core then reports none).
            stats.device_memory_bytes = torch.cuda.memory_allocated(self.device)
        return EngineCoreOutputs(outputs=outputs, stats=stats, timestamp=time.time())

    def _feed_tier(self, sched: SchedulerOutput, result: ModelRunnerOutput, seconds: float) -> None:
        """Hands the blocks this step filled to the tier's writer, and lets it measure what computing
        prompt tokens costs (its restore-or-recompute estimate): steps with prompt work only."""
        for key, payload in result.kv_stored:
            self.kv_tier.put(key, payload)
        num_prompt_tokens = sched.num_scheduled_tokens - len(sched.scheduled)
        if num_prompt_tokens >= MIN_PROMPT_TOKENS_TO_TIME:
            self.kv_tier.costs.observe_compute(sched.num_scheduled_tokens, seconds)

    def _step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        self._fill_grammar_bitmask(sched)
        if self.message_roundtrip:
            sched = roundtrip(sched, SchedulerOutput)
        started = time.perf_counter()
        result = self.executor.execute(sched)  # an empty schedule costs nothing in the runner
        if self.message_roundtrip:
            result = roundtrip(result, ModelRunnerOutput)
        if self.kv_tier is not None:
            self._feed_tier(sched, result, time.perf_counter() - started)
        forced = self._advance_grammars(sched, result)
        # Fast-forwarded and speculating requests get several tokens this step: remember where their
        # new ones start.
        outputs_before = {}
        for item in sched.scheduled:
            if item.request_id in forced or item.request_id in result.accepted:
                outputs_before[item.request_id] = self.scheduler.step_request(item.request_id).num_output_tokens
        finished_requests = self.scheduler.update_from_output(sched, result.sampled, forced, result.accepted)
        if self.config.speculative_config is not None:
            self._propose_drafts(sched, result)
        finished = {r.request_id for r in finished_requests}
        scheduled_ids = {item.request_id for item in sched.scheduled}
        # Requests that ended without running this step (queue timeouts) still report their end.
        outputs = [EngineCoreOutput(request_id=r.request_id, finish_reason=r.status.finish_reason,
                                    stop_reason=r.stop_reason)
                   for r in finished_requests if r.request_id not in scheduled_ids]
        for item in sched.scheduled:
            rid = item.request_id
            request = self.scheduler.step_request(rid)
            token = result.sampled.get(rid)
            prompt_lps = result.prompt_logprobs.get(rid)
            if request is None or (token is None and prompt_lps is None):
                continue
            new_token_ids = [] if token is None else [token]
            if token is not None and rid in outputs_before:  # kept drafts, the sampled token, forced ones
                new_token_ids = request.output_token_ids[outputs_before[rid]:]
            out = EngineCoreOutput(
                request_id=rid,
                new_token_ids=new_token_ids,
                new_logprobs=([*result.accepted_logprobs.get(rid, ()), result.logprobs[rid]]
                              if rid in result.logprobs else None),
                prompt_logprobs=prompt_lps,
                num_cached_tokens=request.num_cached_tokens or 0,
                num_preemptions=request.num_preemptions,
                num_spec_accepted_tokens=request.num_spec_accepted_tokens,
                first_scheduled_time=request.first_scheduled_time,
            )
            if rid in finished:
                out.finish_reason = request.status.finish_reason
                out.stop_reason = request.stop_reason
            outputs.append(out)
        return outputs
