"""Plain-transformers baselines for `make bench`: the same weights, run the way most people would.

- naive: one request at a time, `model.generate` per request (batch of 1, no padding);
- static batches: requests in workload order, cut into batches of `batch_size`, left-padded; each
  batch runs until its longest max_tokens, but only each request's own max_tokens count as output.

Both force exactly max_tokens new tokens (min_new_tokens = max_new_tokens suppresses EOS) and check
it, so their tokens/s compare with tokenmill's like for like.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from tokenmill.bench.throughput import BenchmarkError, check_output_lengths, throughput_result
from tokenmill.bench.workloads import WorkloadRequest

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (choose from {', '.join(_DTYPES)})") from None


def load_hf_model(model: Optional[str], dtype: str, device: str = "cpu"):
    """A transformers causal LM holding the same weights tokenmill serves (None = embedded SmolLM2)."""
    from transformers import AutoModelForCausalLM

    if model is None:
        from tokenmill.model.default_model import default_model_path

        gguf: Optional[Path] = default_model_path()
    else:
        path = Path(model).expanduser()
        gguf = path if path.suffix.lower() == ".gguf" else next(iter(sorted(path.glob("*.gguf"))), None)
        if gguf is None:
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype), local_files_only=True)
            return _prepare(hf.to(device))
    return _prepare(_load_gguf(gguf, torch_dtype(dtype)).to(device))


def _load_gguf(path: Path, dtype: torch.dtype):
    """transformers' own GGUF dequantization; from_pretrained when accelerate is installed.

    from_pretrained(gguf_file=...) insists on accelerate, which tokenmill does not depend on, so
    without it the model is built from the GGUF's config and filled from transformers'
    `load_gguf_checkpoint` -- the same dequantizer and name mapping from_pretrained uses.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    if is_accelerate_available():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                    local_files_only=True)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf, torch_dtype=dtype)["tensors"]
    result = hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise BenchmarkError(f"GGUF weights do not fit the transformers model: missing {missing[:5]}, "
                             f"unexpected {result.unexpected_keys[:5]}")
    return hf


def _prepare(hf):
    hf.eval()
    gen = hf.generation_config
    # Greedy decoding: drop sampling defaults so generate() does not warn about unused flags.
    for name in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
        if hasattr(gen, name):
            setattr(gen, name, None)
    gen.do_sample = False
    return hf


def pad_token_id(hf) -> int:
    for source in (hf.generation_config.pad_token_id, hf.config.pad_token_id,
                   hf.generation_config.eos_token_id, hf.config.eos_token_id):
        if isinstance(source, (list, tuple)):
            source = source[0] if source else None
        if source is not None:
            return int(source)
    return 0


def _generate(hf, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Exactly `new_tokens` greedy tokens per row; returns only the generated part (on the CPU, so a
    timer read after it counts the whole generation on any device)."""
    out = hf.generate(input_ids.to(hf.device), attention_mask=attention_mask.to(hf.device),
                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      pad_token_id=pad_token_id(hf))
    return out[:, input_ids.shape[1]:].cpu()


def _warm_up(hf, requests: Sequence[WorkloadRequest], batch: int) -> None:
    prompt = torch.tensor([list(requests[0].prompt_token_ids[:8])] * batch, dtype=torch.long)
    _generate(hf, prompt, torch.ones_like(prompt), 4)


@torch.inference_mode()
def run_naive(hf, requests: Sequence[WorkloadRequest], *, warmup: bool = True,
              progress: bool = True) -> dict[str, Any]:
    """One request at a time: the latency-optimal, throughput-poor baseline."""
    if warmup:
        _warm_up(hf, requests, 1)
    lengths, finish_times = [], []
    start = time.perf_counter()
    for request in _progress(requests, progress, "naive generate"):
        ids = torch.tensor([request.prompt_token_ids], dtype=torch.long)
        generated = _generate(hf, ids, torch.ones_like(ids), request.max_tokens)
        lengths.append(int(generated.shape[1]))
        finish_times.append(time.perf_counter() - start)
    wall = time.perf_counter() - start
    check_output_lengths("hf-naive", requests, lengths)
    return throughput_result("hf-naive", wall, sum(r.prompt_len for r in requests), sum(lengths), len(requests),
                             concurrency=1, latency_mean_s=round(sum(finish_times) / len(finish_times), 4))


@torch.inference_mode()
def run_static_batches(hf, requests: Sequence[WorkloadRequest], batch_size: int = 16, *, warmup: bool = True,
                       progress: bool = True) -> dict[str, Any]:
    """Left-padded batches in workload order; a batch ends when its longest request does.

    Each row generates the batch's longest max_tokens; a row's tokens past its own max_tokens are
    wasted work and are not counted as output.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if warmup:
        _warm_up(hf, requests, min(2, batch_size))
    pad = pad_token_id(hf)
    counted, finish_times, generated_total = [], [], 0
    batches = [list(requests[i:i + batch_size]) for i in range(0, len(requests), batch_size)]
    start = time.perf_counter()
    for batch in _progress(batches, progress, f"static batches of {batch_size}"):
        input_ids, mask = left_pad([r.prompt_token_ids for r in batch], pad)
        longest = max(r.max_tokens for r in batch)
        generated = _generate(hf, input_ids, mask, longest)
        if generated.shape[1] != longest:
            raise BenchmarkError(f"hf-static: a batch generated {generated.shape[1]} tokens, expected {longest}")
        generated_total += generated.numel()
        counted.extend(r.max_tokens for r in batch)  # each row's useful prefix
        finish_times.extend([time.perf_counter() - start] * len(batch))
    wall = time.perf_counter() - start
    check_output_lengths("hf-static", requests, counted)
    return throughput_result("hf-static", wall, sum(r.prompt_len for r in requests), sum(counted), len(requests),
                             concurrency=batch_size, batch_size=batch_size, generated_tokens_incl_waste=generated_total,
                             latency_mean_s=round(sum(finish_times) / len(finish_times), 4))


def left_pad(prompts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align prompts (decoder-only generation appends on the right) with a 0/1 attention mask.

        [p p a b c]      mask [0 0 1 1 1]
        [d e f g h]           [1 1 1 1 1]
    """
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids, mask


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, leave=False)
