"""The scheduler's statistics, sent to the frontend with every step's outputs (plain data)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.kv_cache_manager import KVCacheManager


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_cached_blocks: int = 0
    num_evictions: int = 0
    num_queue_timeouts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_drafts: int = 0  # verifies that carried at least one draft
    # Index i: how many times a verify kept its draft at position i (vLLM's accepted tokens per position).
    spec_accepted_per_position: list[int] = field(default_factory=list)
    spec_step_draft_limit: int = 0  # set by the engine core: the last step's drafts per request (0: none)
    num_pinned_blocks: int = 0  # blocks requests' cache_ttl_s keep resident now
    num_pins_refused: int = 0  # cumulative: blocks a pin could not hold (the pinned share was full)
    # Filled by the engine core on accelerators: device memory its process holds (bytes).
    device_memory_bytes: int = 0
    # The prefix cache's second tier (core.kv_tier), cumulative but for the last two (gauges).
    kv_offload_enabled: bool = False
    kv_offload_queries: int = 0  # prompt tokens the memory cache lacked (vLLM's external prefix cache queries)
    kv_offload_hits: int = 0  # of those, tokens read back from the tier
    kv_offload_blocks_written: int = 0
    kv_offload_bytes_written: int = 0
    kv_offload_blocks_read: int = 0
    kv_offload_bytes_read: int = 0
    kv_offload_restore_seconds: float = 0.0
    kv_offload_evictions: int = 0
    kv_offload_corrupt: int = 0
    kv_offload_write_errors: int = 0
    kv_offload_read_errors: int = 0
    kv_offload_dropped_writes: int = 0
    kv_offload_skipped_restores: int = 0
    kv_offload_stored_blocks: int = 0
    kv_offload_stored_bytes: int = 0


def tier_stats(kv_cache: KVCacheManager) -> dict:
    """SchedulerStats' kv_offload_* fields for the KV cache's second tier (none without one)."""
    tier = kv_cache.tier
    if tier is None:
        return {}
    counts = tier.stats
    return {"kv_offload_enabled": True, "kv_offload_queries": kv_cache.tier_stats.queries,
            "kv_offload_hits": kv_cache.tier_stats.hits,
            **{"kv_offload_" + name: getattr(counts, name) for name in (
                "blocks_written", "bytes_written", "blocks_read", "bytes_read", "restore_seconds", "evictions",
                "corrupt", "write_errors", "read_errors", "dropped_writes", "skipped_restores", "stored_blocks",
                "stored_bytes")}}
