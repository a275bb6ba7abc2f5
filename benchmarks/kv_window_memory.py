"""KV bytes per token of context for Gemma 3 270M (18 layers: 15 local with a 512-token window, 3 global;
1 KV head of 256 dims, bf16 cache), with sliding-window KV cache groups vs every layer holding every block.

No model runs: the KV cache manager is driven for one request (prompt in 2,048-token chunks, then one
decode) and the blocks it holds per group are counted. Prints the markdown table of docs/benchmarks.md.

    .venv/bin/python -m benchmarks.kv_window_memory
"""
from __future__ import annotations

from transformers import Gemma3TextConfig

from tokenmill.core.kv_cache_groups import plan_kv_cache_groups
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.model.layers.decoder import layer_windows
from tokenmill.sampling_params import SamplingParams

BLOCK_SIZE = 16
CHUNK = 2048


def main() -> None:
    config = Gemma3TextConfig(num_hidden_layers=18, num_key_value_heads=1, head_dim=256, sliding_window=512)
    layout = plan_kv_cache_groups(layer_windows(config))
    per_layer_token = 2 * config.num_key_value_heads * config.head_dim * 2  # K and V, 2 bytes each
    print("| context | blocks held per group (local ... global) | hybrid MiB | KiB/token | every layer full MiB |"
          " KiB/token | saving |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for context in (512, 2048, 8192, 32768):
        blocks = len(layout.groups) * (context // BLOCK_SIZE + 64) + 1
        kv = KVCacheManager(blocks, BLOCK_SIZE, enable_caching=False, group_windows=layout.windows)
        request = Request("a", list(range(context)), SamplingParams(max_tokens=1))
        while request.num_computed_tokens < context:
            count = min(CHUNK, context - request.num_computed_tokens)
            kv.allocate_slots(request, count)
            request.num_computed_tokens += count
        request.append_output_token(0)
        kv.allocate_slots(request, 1)  # the first decode, at position `context`
        held = kv.num_held_blocks("a")
        hybrid = sum(held) * BLOCK_SIZE * layout.layers_per_group * per_layer_token
        full = -(-(context + 1) // BLOCK_SIZE) * BLOCK_SIZE * config.num_hidden_layers * per_layer_token
        print(f"| {context} | {' '.join(map(str, held))} | {hybrid / 2**20:.1f} | {hybrid / context / 1024:.2f} "
              f"| {full / 2**20:.1f} | {full / context / 1024:.2f} | {full / hybrid:.2f}x |")


if __name__ == "__main__":
    main()
