"""Speculative decoding's draft model: proposes the next tokens of every speculating request, in batched
forwards, right after the step that sampled their last token (vLLM's draft-model proposer, on CPU).

The draft model is a ModelRunner of its own (weights, numerics, attention backend, KV cache), run on the
target's input batch: the same token rows and the same block tables. Its KV cache has as many blocks as the
target's, and a request's draft KV sits in the blocks the target's table gives it, so the draft's blocks are
allocated, shared through the prefix cache, preempted and freed with the target's, by the one block manager.
layer_skip's draft is the target's own first layers at its numerics: it reads and writes the target's KV
tensors of those layers (writing only positions the target has not computed yet, which the target's next
step overwrites), so it has no cache of its own and never catches up.

Its KV of a request is written only when the request drafts, and valid as far as this module has checked:
    computed[rid]   positions whose draft KV holds the request's real tokens
    tail[rid]       (position, tokens) the last drafting wrote past those: the sampled token and the drafts
                    before the last; once the target has verified them, the leading ones that it kept count
                    as computed
A drafting step first catches the draft up from `computed` to the sampled token (one chunk per request, a
prefill where the draft has not run for a while: after a prefix-cache hit, preemption or large batches),
which also gives the first draft; each further draft is one decode row per request. Any draft KV that is
stale (a tier restore, a copy-on-write) can only lower the acceptance, never change an output: the target
verifies every draft.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import re
from typing import Optional

import numpy as np
import torch

from tokenmill.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.errors import ModelLoadError
from tokenmill.runner.input_batch import InputBatch

logger = logging.getLogger("tokenmill")

# Catch-ups of up to this many tokens run as decode rows (a verify's layout); longer ones as a prefill chunk.
MAX_DECODE_CATCH_UP = 16
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def draft_engine_config(config):
    """The draft model's settings: the engine's, with the draft's resolved numerics and no LoRA, no draft."""
    spec = config.speculative_config
    return dataclasses.replace(config, dtype=spec.draft_dtype, block_matmul=spec.draft_block_matmul,
                               kv_cache_dtype=spec.draft_kv_cache_dtype, numerics="auto",
                               quantization=spec.draft_quantization,
                               enable_lora=False, speculative_config=None, num_kv_blocks=None)


def layer_skip_config(hf_config, num_layers: int):
    """The target's config cut to its first num_layers layers (per-layer lists too, e.g. Gemma 3's layer_types)."""
    total = hf_config.num_hidden_layers
    if num_layers >= total:
        raise ModelLoadError(f"layer_skip num_layers must be below the model's {total} layers, got {num_layers}")
    cut = copy.deepcopy(hf_config)
    for name, value in vars(hf_config).items():
        if isinstance(value, (list, tuple)) and len(value) == total:
            setattr(cut, name, type(value)(value[:num_layers]))
    cut.num_hidden_layers = num_layers
    return cut


def _first_layers(weights, num_layers: int, int8_blocks: Optional[dict]):
    """The checkpoint's weights of layers below num_layers (and every non-layer weight); kept int8 blocks of
    the layers dropped are removed once the stream ends, before the runner builds its linear layers."""
    for name, tensor in weights:
        match = _LAYER.search(name)
        if match is None or int(match.group(1)) < num_layers:
            yield name, tensor
    if int8_blocks:
        for name in [n for n in int8_blocks if (m := _LAYER.search(n)) and int(m.group(1)) >= num_layers]:
            del int8_blocks[name]


class Drafter:
    def __init__(self, config, source, target) -> None:
        """source: the draft's model source (the target's own for qspec and layer_skip); target: the target's
        ModelRunner (weights loaded); the draft is a runner of the same class."""
        if source is None:
            raise ValueError("a draft model needs its model source (engine.draft_setup.resolve_draft)")
        spec = config.speculative_config
        draft_config = draft_engine_config(config)
        hf_config = source.hf_config
        self.num_layers = None
        if spec.method == "layer_skip":
            self.num_layers = spec.num_layers or max(1, hf_config.num_hidden_layers // 2)
            hf_config = layer_skip_config(hf_config, self.num_layers)
        self.target = target
        self.runner = type(target)(draft_config, hf_config, source.architecture, target.device, target.max_model_len)
        int8_blocks = {} if self.runner.linear_methods.keeps_int8_blocks(source.is_gguf) else None
        weights = source.iter_weights(self.runner.dtype, int8_blocks)
        if self.num_layers is not None:
            weights = _first_layers(weights, self.num_layers, int8_blocks)
        self.runner.load_weights(weights, int8_blocks)
        # layer_skip's layers are the target's first ones, at its numerics: their KV is the target's, so the
        # draft reads and writes the target's cache (as LayerSkip reuses it) and never catches up.
        self.shares_kv = self.num_layers is not None
        windows = self.runner.kv_layout.windows
        if not self.shares_kv and tuple(windows) != tuple(target.kv_layout.windows):
            raise ModelLoadError("the draft model's attention windows differ from the target's "
                                 f"({windows} vs {target.kv_layout.windows}): its KV cache cannot "
                                 "follow the target's block tables")
        # ids past the smaller vocabulary are padding, never text
        self.vocab_size = min(hf_config.vocab_size, target.hf_config.vocab_size)
        self.computed: dict[str, int] = {}
        self.tail: dict[str, tuple[int, list[int]]] = {}
        self.probs: dict[str, list[torch.Tensor]] = {}  # a sampled request's q rows, one per draft
        logger.info("draft model (%s): %s%s, %s", spec.method, source.path,
                    f", the first {self.num_layers} layers on the target's KV cache" if self.shares_kv else "",
                    self.runner.linear_layers)

    @property
    def bytes_per_block(self) -> int:
        """What the draft adds to a KV block (nothing where it reads the target's cache)."""
        return 0 if self.shares_kv else self.runner.kv_spec.bytes_per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.shares_kv:
            self.runner.layer_kv_caches = self.target.layer_kv_caches[:self.num_layers]
        else:
            self.runner.initialize_kv_cache(num_blocks)

    def forget(self, output: SchedulerOutput) -> None:
        """Requests the runner dropped or (re)described in full: their draft KV is no longer theirs."""
        for request_id in (*output.finished_ids, *output.preempted_ids,
                           *(new.request_id for new in output.new_requests)):
            self.computed.pop(request_id, None)
            self.tail.pop(request_id, None)
            self.probs.pop(request_id, None)

    def propose(self, output: SchedulerOutput, batch: InputBatch, result: ModelRunnerOutput) -> None:
        """After the target's step: updates what the draft KV holds, then drafts for the items that ask."""
        self.forget(output)
        drafting: list[tuple[ScheduledRequest, int]] = []  # (item, position of its sampled token)
        for item in output.scheduled:
            rid = item.request_id
            state = batch.requests[rid]
            kept = len(result.accepted.get(rid) or ())
            known_end = item.start_position + item.num_new_tokens - len(item.spec_token_ids) + kept
            # Sharing the target's KV, the draft has every position the target computed.
            computed = known_end if self.shares_kv else self._verified(rid, state.row, batch, known_end)
            token = result.sampled.get(rid)
            if item.draft_tokens and token is not None:
                batch.token_ids[state.row, known_end] = token
                drafting.append((item, known_end))
            self.computed[rid] = min(computed, known_end)
        if drafting:
            self._draft(drafting, batch, result)

    def _verified(self, rid: str, row: int, batch: InputBatch, known_end: int) -> int:
        """The positions whose draft KV holds real tokens: the computed ones, and the drafted tail's leading
        tokens that the sequence now has (up to known_end, where its tokens stop being final)."""
        computed = self.computed.get(rid, 0)
        tail = self.tail.pop(rid, None)
        if tail is None:
            return computed
        start, tokens = tail
        end = min(start + len(tokens), known_end)
        if start > computed or end <= start:
            return computed
        same = batch.token_ids[row, start:end] == np.asarray(tokens[:end - start])
        return start + (int(np.argmin(same)) if not same.all() else len(same))

    def _draft(self, drafting: list[tuple[ScheduledRequest, int]], batch: InputBatch,
               result: ModelRunnerOutput) -> None:
        # The first forward: each request's catch-up to its sampled token; its last row gives the first draft.
        items = [self._catch_up(item.request_id, self.computed[item.request_id], position + 1)
                 for item, position in drafting]
        drafts: dict[str, list[int]] = {item.request_id: [] for item, _ in drafting}
        positions = {item.request_id: position for item, position in drafting}
        wanted = {item.request_id: item.draft_tokens for item, _ in drafting}
        for rid in drafts:
            self.probs.pop(rid, None)
        while items:
            tokens = self._choose(items, self._forward(items, batch), batch)
            following = []
            for item, token in zip(items, tokens):
                rid = item.request_id
                if token >= self.vocab_size:  # a padded vocabulary's slot: no draft beyond it
                    continue
                drafts[rid].append(token)
                if len(drafts[rid]) < wanted[rid]:
                    position = positions[rid] + len(drafts[rid])
                    batch.token_ids[batch.requests[rid].row, position] = token
                    following.append(ScheduledRequest(rid, position, 1, []))
            items = following
        for rid, proposed in drafts.items():
            position = positions[rid]
            # Written: the catch-up's real tokens, then the sampled token's KV and every draft's but the last
            # (never fed back).
            self.computed[rid] = position
            self.tail[rid] = (position, [int(batch.token_ids[batch.requests[rid].row, position]), *proposed[:-1]])
            result.drafts[rid] = proposed

    @staticmethod
    def _catch_up(request_id: str, start: int, end: int) -> ScheduledRequest:
        """Positions start..end-1 of a request. A short run is laid out as a verify is, one decode row per
        position (`spec_token_ids` only marks them: the tokens come from the batch's rows), so it takes the
        decode path (the fused decoder stack) instead of a prefill chunk's."""
        count = end - start
        return ScheduledRequest(request_id, start, count, [],
                                spec_token_ids=[0] * (count - 1) if 1 < count <= MAX_DECODE_CATCH_UP else [])

    def _choose(self, items: list[ScheduledRequest], logits: torch.Tensor, batch: InputBatch) -> list[int]:
        """Each item's next draft: a greedy request's argmax; a sampled request's drawn from the draft's
        distribution q as its sampling parameters shape it, q's row kept for the verify (speculative sampling
        then keeps the target's distribution with far more drafts kept than point-mass guesses would be)."""
        tokens = self.runner.sampler.argmax(logits).tolist()
        sampled = [i for i, item in enumerate(items)
                   if not batch.requests[item.request_id].sampling_params.greedy]
        if not sampled:
            return tokens
        # Each item's logits predict the position after its last.
        states = [batch.sampling_state(batch.requests[items[i].request_id],
                                       items[i].start_position + items[i].num_new_tokens) for i in sampled]
        drawn, probs = self.runner.sampler.sample_drafts(logits[sampled], states)
        for i, token, row in zip(sampled, drawn, probs):
            tokens[i] = token
            self.probs.setdefault(items[i].request_id, []).append(row)
        return tokens

    def draft_probs(self, request_id: str, num_drafts: int, vocab_size: int) -> Optional[torch.Tensor]:
        """q's rows of the request's first num_drafts drafts ([num_drafts, vocab_size]), or None when they were
        not drawn from a distribution (greedy drafts: point masses)."""
        rows = self.probs.get(request_id)
        if not rows or len(rows) < num_drafts:
            return None
        q = torch.stack(rows[:num_drafts])
        if q.shape[1] != vocab_size:  # the two models' logits differ in padding only (same vocabulary)
            q = torch.nn.functional.pad(q[:, :vocab_size], (0, max(0, vocab_size - q.shape[1])))
        return q

    def _forward(self, items: list[ScheduledRequest], batch: InputBatch) -> torch.Tensor:
        """One draft forward over `items`' positions of the target's rows: the logits after each item's last."""
        runner = self.runner
        backend = runner.attention_backend
        states = [batch.requests[item.request_id] for item in items]
        inputs = batch.prepare(items, states, runner.device, backend.paged_decode)
        metas = [backend.prepare_metadata(group_inputs) for group_inputs in inputs.attention]
        groups = (self.target if self.shares_kv else runner)._layer_group  # layer -> its KV cache group
        meta = metas[0] if len(metas) == 1 else [metas[group] for group in groups[:len(runner.layer_kv_caches)]]
        hidden = runner.model(inputs.input_ids, inputs.positions, runner.layer_kv_caches, meta)
        return runner.model.compute_logits(hidden[inputs.last_token_index])
