"""Speculative decoding with a draft model, decided at engine start: the draft's checkpoint checked against
the target's (the same vocabulary), and the numerics it runs at resolved from the hardware, as the
target's are (runner.numerics). The runner loads it (runner/drafter.py) from the source this returns and
what it writes into the speculative config."""
from __future__ import annotations

import dataclasses
import logging

from tokenmill.config import EngineConfig, SpeculativeConfig
from tokenmill.errors import ModelLoadError
from tokenmill.model.loader import ModelSource, load_model_source
from tokenmill.runner.numerics import Hardware, Numerics, has_experts, resolve_numerics

logger = logging.getLogger("tokenmill")


def check_same_vocabulary(target_tokenizer, draft_tokenizer, draft_path: str) -> None:
    """Drafts are token ids the target verifies: both models must mean the same text by every id."""
    if target_tokenizer is None or draft_tokenizer is None:
        return
    target, draft = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target != draft:
        differing = sorted(set(target.items()) ^ set(draft.items()))
        raise ModelLoadError(
            f"the draft model {draft_path} has a different vocabulary from the target's ({len(draft)} tokens vs "
            f"{len(target)}, {len(differing)} token ids differ, e.g. {differing[0]!r}); a draft model must share "
            "the target's tokenizer")


def resolve_draft(config: EngineConfig, target_source, hardware: Hardware,
                  target: Numerics) -> tuple[SpeculativeConfig, ModelSource]:
    """The speculative config with the draft's numerics filled in (draft_dtype, draft_block_matmul,
    draft_kv_cache_dtype, draft_quantization), and the draft's model source (the target's own for qspec and
    layer_skip), loaded once here. config: the engine's, its own numerics already resolved."""
    spec = config.speculative_config
    source = target_source
    if spec.method == "draft_model":
        source = load_model_source(spec.model)
        check_same_vocabulary(target_source.tokenizer, source.tokenizer, spec.model)
    if spec.method == "layer_skip":  # the target's own first layers, on its KV cache: its numerics exactly
        logger.info("draft numerics: the target's (%s)", target.describe())
        return dataclasses.replace(spec, draft_dtype=target.dtype.value, draft_block_matmul=target.block_matmul.value,
                                   draft_kv_cache_dtype=target.kv_cache_dtype.value,
                                   draft_quantization=config.quantization), source
    blocks = source.has_int8_block_matrices()
    # The draft's fastest numerics, as the target's are chosen (a dense draft's weights rounded to Q8_0 at
    # load where the int8 dot products run).
    wanted = dataclasses.replace(config, numerics=spec.numerics, dtype="auto", block_matmul="auto",
                                 kv_cache_dtype="auto", quantization=None, speculative_config=None)
    numerics = resolve_numerics(wanted, hardware, blocks, experts=has_experts(source.hf_config))
    quantization = "q8_0" if numerics.weights.value == "q8_0" else None
    if spec.method == "qspec" and (numerics.dtype.value, numerics.block_matmul.value) == (
            target.dtype.value, target.block_matmul.value):
        raise ModelLoadError(
            f"qspec drafts through a faster path than the target's, but this engine already computes at its "
            f"fastest ({numerics.describe()}): start the target with --numerics exact, or use another method "
            "(layer_skip, draft_model)")
    if spec.method == "qspec" and blocks:
        logger.warning("qspec on block-quantized weights: the exact path multiplies the same kept blocks the "
                       "draft does, so a draft costs most of a target step (0.82x at one stream measured on the "
                       "embedded GGUF); it pays on dense checkpoints (docs/benchmarks.md)")
    logger.info("draft numerics: %s%s", numerics.describe(), "; weights rounded to Q8_0" if quantization else "")
    return dataclasses.replace(spec, draft_dtype=numerics.dtype.value, draft_block_matmul=numerics.block_matmul.value,
                               draft_kv_cache_dtype=numerics.kv_cache_dtype.value,
                               draft_quantization=quantization), source
