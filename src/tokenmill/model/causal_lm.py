"""`DecoderForCausalLM`: embeddings, a stack of `DecoderLayer`s, the final norm and the LM head, with
everything the runner asks of a model in one place for every family.

A family subclass only says how its HF config reads as a `DecoderSpec` (`build_spec`). The runner's
hooks live here: `convert_linear_layers` (packed / block-int8 projections), `checkpoint_weight_names`
(which checkpoint matrices a fused projection stacks), and `enable_int8_decode` (the whole stack as
one C++ call for decode steps, and for steps that prefill where their chunks take the C++ kernels), which
declines, with a log line naming the reason, for models whose layers the fused kernel does not implement (a
partial rotary, mixture-of-experts MLPs).
"""
from __future__ import annotations

import logging
from typing import Any, Container, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import TensorParallelGroup
from tokenmill.errors import ModelLoadError
from tokenmill.model.layers.attention import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.basic import RMSNorm, RotaryEmbedding
from tokenmill.model.layers.decoder import DecoderLayer, DecoderSpec
from tokenmill.model.layers.linear import (
    BLOCK_KERNEL_MAX_ROWS,
    Bf16TileInt8RowKernels,
    Bf16TileKernels,
    BlockQuantEmbedding,
    BlockQuantLinear,
    Int8Blocks,
    LinearFactory,
    replace_linear_layers,
)
from tokenmill.model.layers.moe import expert_destination
from tokenmill.model.layers.parallel import VocabParallelEmbedding, gather_logits, shard_spec

logger = logging.getLogger("tokenmill")


class DecoderForCausalLM(nn.Module):
    # Checkpoint names that are fused into one of our parameters: (ours, theirs, shard index).
    _FUSED = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
              ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    @classmethod
    def build_spec(cls, config) -> DecoderSpec:
        raise NotImplementedError

    def __init__(self, config, backend: AttentionBackend, max_positions: int, device: torch.device,
                 tp: Optional[TensorParallelGroup] = None) -> None:
        """tp: this rank's tensor-parallel group; the model then holds the rank's shard
        (`model.layers.parallel`): its heads, MLP features and vocabulary rows."""
        super().__init__()
        self.config = config
        try:
            spec = self.build_spec(config)
            rotaries = {_rope_key(key): RotaryEmbedding(config, spec.head_dim, max_positions, device, layer_type=key)
                        for key in dict.fromkeys(spec.layer_rope)}
        except ValueError as exc:  # a config feature the family's layers do not implement: refuse to load
            raise ModelLoadError(f"{type(self).__name__}: {exc}") from None
        self.vocab_size = spec.vocab_size  # the whole vocabulary, what compute_logits returns
        self.tp = tp if tp is not None and tp.size > 1 else None
        if self.tp is not None:
            spec = shard_spec(spec, self.tp.size)
        self.spec = spec
        reduce = None if self.tp is None else self.tp.all_reduce
        self.embed_tokens = (nn.Embedding(spec.vocab_size, spec.hidden_size) if self.tp is None
                             else VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, self.tp))
        # HF keeps the scale as a float32 tensor cast to the weights' dtype; the same here, so bf16 rounds alike.
        self.embed_scale: Optional[torch.Tensor]
        self.register_buffer("embed_scale", None if spec.embed_scale is None else torch.tensor(spec.embed_scale),
                             persistent=False)
        # One rotary table per distinct rope (Gemma 3: global and local layers differ in base).
        self.rotaries = nn.ModuleDict(rotaries)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, backend, self.rotaries[_rope_key(rope)], window, sparse, reduce)
            for rope, window, sparse in zip(spec.layer_rope, spec.layer_windows, spec.layer_sparse))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # (kernels, per-layer tensors, per-layer rotary cos and sin tables, per-layer windows), listed once
        self._int8_decode: Optional[tuple[Any, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                                          list[int]]] = None
        # Whether the fused stack also runs steps that prefill (and decode steps of any size): its projections then
        # take any number of rows, which holds unless the bfloat16 modes send steps of over 64 rows to other
        # kernels than the stack's.
        self.fused_stack_prefills = False
        self.lora_state: Optional[Any] = None  # --enable-lora: the step's rows' adapters (layers.lora.LoRAStepState)
        # LoRA's (A, Bᵀ), offsets and rank for the fused stack, listed at its first step with adapter rows (the
        # adapters' projections wrap the stack's after it is enabled) rather than every step.
        self._stack_lora_lists: Optional[tuple[list[torch.Tensor], list[list[int]], int]] = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale.to(x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        """kv_caches: one per layer. meta: the step's attention metadata, or one per layer where layers
        read different block tables (KV cache groups of sliding-window and global layers)."""
        metas = meta if isinstance(meta, list) else [meta] * len(self.layers)
        rows = input_ids.numel()
        if (self._int8_decode is not None and metas[0].decode_block_tables is not None
                and self._fused_decode_fits(kv_caches)
                and (self.lora_state is None or not self.lora_state.active
                     or self.lora_state.token_slots is not None)):  # adapters: the stack runs lora_add too
            if metas[0].num_decodes == rows and (rows <= BLOCK_KERNEL_MAX_ROWS or self.fused_stack_prefills):
                return self._forward_int8_decode(input_ids, positions, kv_caches, metas)
            prefill = self._stack_prefill(metas, kv_caches) if metas[0].num_decodes < rows else None
            if prefill is not None:
                return self._forward_int8_decode(input_ids, positions, kv_caches, metas, prefill)
        x, residual = self.embed(input_ids), None
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, metas):
            x, residual = layer(positions, x, residual, kv_cache, layer_meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied, before convert_linear_layers
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        logits = gather_logits(logits, self.tp, self.vocab_size)
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ---- the fused int8 decode stack -------------------------------------------------------
    def int8_decode_blocker(self) -> Optional[str]:
        """Why the fused C++ decode stack cannot run this model, or None when it can.

        The kernel implements the decoder layer of every dense family whose rotary turns whole heads: pre-norms,
        optional per-head q/k norms and Gemma's sandwich norms, SiLU or GELU-tanh, full or sliding-window
        attention, per-layer rotary tables, attention logit soft-capping.
        """
        spec = self.spec
        if spec.activation not in ("silu", "gelu_pytorch_tanh", "gelu_tanh"):
            return f"activation {spec.activation}"
        if any(rotary.rotary_dim != spec.head_dim for rotary in self.rotaries.values()):
            return "a partial rotary"
        if any(spec.layer_sparse):
            return "mixture-of-experts layers"
        return None

    def enable_int8_decode(self, kernels: Any) -> bool:
        """Run decode-only steps as one C++ call over the whole stack (`decoder_decode_int8`), and steps with
        prefill chunks (beside decodes or alone) whose chunks all take the C++ prefill kernels; under the
        bfloat16 block modes, whose projections of over BLOCK_KERNEL_MAX_ROWS rows take other kernels, decode-only
        steps of up to that many rows only.

        Same kernels in the same order as the layers, so the same bits; it skips the Python and dispatch of
        every layer, most of a small decode step's non-matmul time, during which the other cores wait. Needs
        every projection in block-quantized form and the rotary/norm kernels (use_cpu_kernels); returns whether
        it was enabled.
        """
        blocker = self.int8_decode_blocker()
        if self.tp is not None:
            blocker = "the all-reduces of tensor parallelism between its layers"
        if blocker is not None:
            logger.info("%s: decode steps run layer by layer (the fused int8 decode stack lacks %s)",
                        type(self).__name__, blocker)
            return False
        params: list[torch.Tensor] = []
        none = torch.empty(0)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if (not all(isinstance(linear, BlockQuantLinear) for linear in linears)
                    or layer.input_layernorm.kernels is None or attn.rotary.kernels is None):
                return False
            qkv, o, gate_up, down = ([linear.q, linear.scales, none if linear.mins is None else linear.mins,
                                      none if linear.bias is None else linear.bias] for linear in linears)
            qk_norms = [none, none] if attn.q_norm is None else [attn.q_norm.weight, attn.k_norm.weight]
            sandwich = ([layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight]
                        if layer.sandwich else [none, none])
            params += [layer.input_layernorm.weight, *qkv, *o, layer.post_attention_layernorm.weight, *gate_up, *down,
                       *qk_norms, *sandwich]
        attns = [layer.self_attn for layer in self.layers]
        self._int8_decode = (kernels, params, [attn.rotary.cos for attn in attns], [attn.rotary.sin for attn in attns],
                             [attn.window or 0 for attn in attns])
        self.fused_stack_prefills = not isinstance(kernels, (Bf16TileKernels, Bf16TileInt8RowKernels))
        return True

    def _fused_decode_fits(self, kv_caches: list[torch.Tensor]) -> bool:
        """Windowed layers past their window attend through the prefill kernel, which reads blocks of a multiple
        of 8 tokens (the Python backend takes its torch path otherwise)."""
        return kv_caches[0].shape[2] % 8 == 0 or all(layer.self_attn.window is None for layer in self.layers)

    def _stack_prefill(self, metas: list[AttentionMetadata],
                       kv_caches: list[torch.Tensor]) -> Optional[tuple[list[Any], bool]]:
        """A step's prefill chunks for the fused stack, per layer (its KV cache group's tables) with whether
        the bfloat16 kernel takes them; None where the stack cannot run the step as the layers would: some chunk
        goes to SDPA, the bfloat16 modes' projections, or blocks the prefill kernels do not read."""
        attn = self.layers[0].self_attn
        choose = getattr(attn.backend, "stack_prefill_tables", None)
        if not self.fused_stack_prefills or choose is None or kv_caches[0].shape[2] % 8:
            return None
        chosen = [choose(meta, attn.head_dim, attn.softcap) for meta in metas]
        if any(choice is None for choice in chosen):
            return None
        return [tables for tables, _ in chosen], chosen[0][1]

    def _forward_int8_decode(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                             metas: list[AttentionMetadata],
                             prefill: Optional[tuple[list[Any], bool]] = None) -> torch.Tensor:
        """metas: each layer's (its KV cache group's) attention metadata; prefill: the step's prefill chunks
        (_stack_prefill), None for a decode-only step."""
        kernels, params, cos, sin, windows = self._int8_decode
        attn = self.layers[0].self_attn
        tables, bf16_prefill = prefill if prefill is not None else ([], False)
        return kernels.decoder_decode_int8(
            self.embed(input_ids), positions, [meta.slot_mapping for meta in metas],
            [meta.decode_block_tables for meta in metas], [meta.decode_context_lens for meta in metas],
            metas[0].decode_ranges, kv_caches, params,  # each row a one-token chunk, for windowed layers
            cos, sin, windows, self.norm.weight, attn.num_heads, attn.num_kv_heads,
            attn.head_dim, self.norm.eps, attn.scale, attn.softcap or 0.0, self.spec.activation != "silu",
            getattr(kernels, "int8_activations", False), *self._stack_lora(), metas[0].num_decodes,
            [t.block_table for t in tables], tables[0].query_ranges if tables else torch.empty(0, 2, dtype=torch.int32),
            [t.context_lens for t in tables], bf16_prefill)

    def _stack_lora(self) -> tuple[list[torch.Tensor], list[list[int]], torch.Tensor, int]:
        """The fused stack's LoRA arguments: every layer's (A, Bᵀ) of qkv, o, gate_up and down with their part
        offsets, each row's slot and the rank, when the step has adapter rows (else empty)."""
        state = self.lora_state
        if state is None or state.token_slots is None:
            return [], [], torch.empty(0, dtype=torch.long), 0
        if self._stack_lora_lists is None:  # the slots' buffers are filled in place: the same tensors every step
            projections = [projection for layer in self.layers for projection in
                           (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                            layer.mlp.down_proj)]
            weights = [tensor for projection in projections for tensor in (projection.lora_a, projection.lora_bt)]
            self._stack_lora_lists = (weights, [projection.offsets for projection in projections],
                                      projections[0].max_rank)
        weights, offsets, rank = self._stack_lora_lists
        return weights, offsets, state.token_slots, rank

    # ---- runner hooks for linear layers ----------------------------------------------------
    def convert_linear_layers(self, make: LinearFactory) -> None:
        """After loading: every projection and the LM head rebuilt by make(name, weight, bias) (packed,
        block-quantized).

        A tied head gets its own converted copy; the embedding lookup keeps its plain weights unless
        `keep_embedding_blocks` replaces them.
        """
        replace_linear_layers(self, make)
        if self.lm_head is None:
            self.lm_head = make("lm_head", self.embed_tokens.weight, None)

    def keep_embedding_blocks(self, blocks: Optional[Int8Blocks], kernels: Any) -> bool:
        """Look embeddings up from block-quantized storage instead of a float table: the tied LM head's
        own blocks when it has them, else `blocks` (the file's token embedding). Returns whether it did.
        Whenever the file's embedding is blocks this replaces the float table, which was never filled.
        Under tensor parallelism the vocabulary-parallel table stays (it was filled at load). The table
        lives on the model's device and its rows come out in the model's dtype (the final norm's)."""
        if self.tp is not None:
            return False
        if self.tie_word_embeddings and isinstance(self.lm_head, BlockQuantLinear):
            table = self.lm_head
        elif blocks is not None:
            table = BlockQuantLinear(blocks, None, kernels, device=self.norm.weight.device)
        else:
            return False
        self.embed_tokens = BlockQuantEmbedding(table, dtype=self.norm.weight.dtype)
        return True

    def checkpoint_part_rows(self, module_name: str) -> list[int]:
        """The output rows each of checkpoint_weight_names(module_name) contributes, in order."""
        leaf = module_name.rpartition(".")[2]
        if leaf == "qkv_proj":
            attn = self.layers[0].self_attn
            return [attn.q_size, attn.kv_size, attn.kv_size]
        if leaf == "gate_up_proj":
            return [self.spec.intermediate_size] * 2
        if module_name == "lm_head":
            return [self.spec.vocab_size]
        return [self.get_submodule(module_name).out_features]

    def checkpoint_weight_names(self, module_name: str) -> list[str]:
        """The checkpoint tensors whose rows, stacked in order, are this linear module's weight."""
        if module_name == "lm_head":
            return ["model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"]
        prefix, _, leaf = module_name.rpartition(".")
        parts = [theirs for ours, theirs, _ in self._FUSED if ours == leaf] or [leaf]
        return [f"model.{prefix}.{part}.weight" for part in parts]

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], skip: Container[str] = ()) -> None:
        """Copies each (checkpoint name, tensor) into its parameter. Names in `skip` (checked as each
        arrives: the loader fills it while streaming) count as loaded but are not copied: matrices the
        runner keeps block-quantized, whose float parameter is dropped without its pages ever being written."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}  # elements written per parameter: a fused one fills from several tensors
        for checkpoint_name, tensor in weights:
            name = checkpoint_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, index = self._destination(name)
            if target not in params:
                raise KeyError(f"unexpected weight {name}")
            dest = params[target] if index is None else params[target][index]
            if dest.shape != tensor.shape:
                raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            if checkpoint_name in skip:
                filled[target] = filled.get(target, 0) + dest.numel()
                continue
            with torch.no_grad():
                dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + dest.numel()
        missing = [n for n, param in params.items() if filled.get(n, 0) < param.numel()]
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {missing[:5]}")
        if self.spec.norm_weight_offset:
            # (1 + w) computed once here in the weights' dtype, as HF computes it per call in float32; the
            # same values in float32, and every norm kernel stays the plain x * w one.
            with torch.no_grad():
                for module in self.modules():
                    if isinstance(module, RMSNorm):
                        module.weight.add_(self.spec.norm_weight_offset)

    def _destination(self, name: str) -> tuple[str, Optional[tuple]]:
        """Our parameter for a checkpoint tensor, and the index of the part it fills (None: all of it)."""
        expert = expert_destination(name, self.spec.moe_intermediate_size)
        if expert is not None:
            return expert
        for ours, theirs, shard in self._FUSED:
            if f".{theirs}." in name:
                target = name.replace(f".{theirs}.", f".{ours}.")
                offset, size = self._shard_range(target, shard)
                return target, (slice(offset, offset + size),)
        return name, None

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        if ".qkv_proj." in target:
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.spec.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]


def _rope_key(layer_type: Optional[str]) -> str:
    return layer_type or "default"
