"""The scheduler's statistics, sent to the frontend with every step's outputs (plain data)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

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
    # The prefix cache's second tier (core.kv_tier), None without one: "queries" (prompt tokens the memory
    # cache lacked: vLLM's external prefix cache queries), "hits" (of those, tokens read back) and the tier's
    # KVTierStats counters by name (cumulative; stored_blocks and stored_bytes are gauges).
    kv_offload: Optional[dict[str, float]] = None
    # --enable-lora: LoRA adapter name -> its running / waiting requests (None without --enable-lora).
    lora_running: Optional[dict[str, float]] = None
    lora_waiting: Optional[dict[str, float]] = None


def lora_counts(requests) -> dict[str, float]:
    """LoRA adapter name -> how many of these requests use it."""
    counts: dict[str, float] = {}
    for request in requests:
        if request.lora is not None:
            counts[request.lora.lora_name] = counts.get(request.lora.lora_name, 0) + 1
    return counts


def tier_stats(kv_cache: KVCacheManager) -> Optional[dict[str, float]]:
    """SchedulerStats.kv_offload for the KV cache's second tier (None without one)."""
    if kv_cache.tier is None:
        return None
    return {**kv_cache.tier.counters(), "queries": kv_cache.tier_stats.queries, "hits": kv_cache.tier_stats.hits}
