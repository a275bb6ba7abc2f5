"""Opening the prefix cache's second tier (core.kv_tier) for an engine core: its fingerprint, named from
everything that changes a KV block's bytes, and the checks that it can serve this engine."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from tokenmill.config import EngineConfig
from tokenmill.core.kv_tier import KVTier, files_digest, fingerprint_of
from tokenmill.errors import ModelLoadError

logger = logging.getLogger("tokenmill")

# --kv-offload-host-size when unset: on CUDA a level in host memory before the disk (as vLLM's offloading
# keeps one); on CPU none (the KV cache is host memory already, and the OS page cache keeps recent files).
DEFAULT_CUDA_HOST_BYTES = 4 * 2**30


def _model_files(path: Path) -> list[Path]:
    """The files that make a model: a GGUF, or a directory's top-level files (weights, config, tokenizer)."""
    if path.is_file():
        return [path]
    return [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]


def tier_fingerprint(config: EngineConfig, model_path: Path, bytes_per_rank: int, device_type: str) -> dict:
    """What a block's bytes depend on, as plain data (the tier hashes it; fingerprint.json shows it)."""
    tokenizer = config.tokenizer
    return {
        "model": files_digest(_model_files(model_path)),
        "tokenizer": files_digest(_model_files(Path(tokenizer))) if tokenizer else "the model's",
        "device": device_type,
        "dtype": config.dtype,
        "kv_cache_dtype": config.kv_cache_dtype,
        "block_matmul": config.block_matmul,
        "quantization": config.quantization,
        "block_size": config.block_size,
        "tensor_parallel_size": config.tensor_parallel_size,
        "block_bytes_per_rank": bytes_per_rank,
    }


def open_kv_tier(config: EngineConfig, model_path: Path, bytes_per_rank: int, device_type: str) -> Optional[KVTier]:
    """The tier under --kv-offload-dir, or None without one. config: the resolved one (numerics applied).
    bytes_per_rank: a KV block's bytes on one tensor-parallel rank; a stored block holds every rank's."""
    if config.kv_offload_dir is None:
        return None
    if not config.enable_prefix_caching:
        raise ModelLoadError("--kv-offload-dir extends the prefix cache: it cannot be used with "
                             "--no-enable-prefix-caching")
    components = tier_fingerprint(config, model_path, bytes_per_rank, device_type)
    host_bytes = config.kv_offload_host_size
    if host_bytes is None:
        host_bytes = DEFAULT_CUDA_HOST_BYTES if device_type == "cuda" else 0
    return KVTier(Path(config.kv_offload_dir).expanduser(), config.kv_offload_size, fingerprint_of(components),
                  bytes_per_rank * config.tensor_parallel_size, components, host_budget_bytes=host_bytes)
