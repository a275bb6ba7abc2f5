"""Tiny random models for tests, saved locally as safetensors."""
from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_llama(directory: Path, tokenizer, *, seed: int = 0, **overrides) -> Path:
    """A random LlamaForCausalLM small enough for CPU tests, saved as safetensors with a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


# Prompts of mixed lengths for greedy parity tests against HF transformers.
GOLDEN_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a king who had three daughters. The eldest was",
    "1, 2, 3, 4, 5,",
    "Q: What is the boiling point of water at sea level?\nA:",
    "List three primary colors:",
    "In machine learning, a transformer is a deep learning architecture that relies on the attention mechanism, "
    "first described in the 2017 paper. Unlike recurrent networks, transformers process all tokens of a sequence "
    "in parallel, which makes them efficient to train on modern hardware. Explain why:",
    "Hi",
]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy `generate` that, like ignore_eos, neither stops at nor suppresses EOS."""
    # generate() falls back to the model's own EOS ids wherever the config leaves them unset.
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
    tokens = out[0, len(prompt_ids):].tolist()
    assert len(tokens) == max_new_tokens
    return tokens
