"""Which layers share a block table: KV cache groups for models that mix sliding-window and global layers.

A layer with a sliding window of w tokens never reads keys more than w - 1 positions behind its query, so
its KV blocks can be dropped once the window has passed them, while a global layer keeps every block.
Layers with the same window therefore share one block table (a *group*), and each group's table is kept
by the rule of its window.

All groups draw from one block pool. To make a block of one group the same size as a block of another,
every group holds the same number of layers, g = gcd of the layer counts of each window kind, and the
KV memory is g tensors of [2, num_blocks, block_size, heads, dim]: layer j of each group (j < g) keeps its
K/V in tensor j. Block ids are unique across groups, so two groups never write the same slot.

    Gemma 3 270M, 18 layers: 15 local (window 512), 3 global -> g = 3, six groups
      group 0: layers 0 1 2   (local)     tensor 0 1 2
      group 1: layers 3 4 6   (local)
      group 2: layers 5 11 17 (global)
      group 3: layers 7 8 9   (local)     ...
    Mistral (every layer windowed) and Llama (none) stay one group of every layer, as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    window: Optional[int]  # the layers' sliding window, None for full attention
    layers: tuple[int, ...]  # model layer indices, in order; layers[j] keeps its K/V in tensor j


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]

    @property
    def layers_per_group(self) -> int:
        return len(self.groups[0].layers)

    @property
    def windows(self) -> tuple[Optional[int], ...]:
        return tuple(group.window for group in self.groups)

    def layer_group(self) -> list[int]:
        """Group index of each model layer."""
        owner = {layer: g for g, group in enumerate(self.groups) for layer in group.layers}
        return [owner[layer] for layer in range(len(owner))]

    def layer_tensor(self) -> list[int]:
        """Which of the layers_per_group KV tensors each model layer uses."""
        slot = {layer: j for group in self.groups for j, layer in enumerate(group.layers)}
        return [slot[layer] for layer in range(len(slot))]


def plan_kv_cache_groups(layer_windows: Sequence[Optional[int]]) -> KVCacheLayout:
    """Split layers into equal-sized groups of one window each, ordered by their first layer."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    kinds: dict[Optional[int], list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    groups = [KVCacheGroup(window, tuple(layers[i:i + size]))
              for window, layers in kinds.items() for i in range(0, len(layers), size)]
    groups.sort(key=lambda group: group.layers[0])
    return KVCacheLayout(tuple(groups))


def blocks_per_sequence(group_windows: Sequence[Optional[int]], length: int, block_size: int) -> int:
    """The blocks one request of `length` tokens holds across the groups while it decodes its last token: a
    full-attention group every block of its context, a sliding-window group those from the block its window
    reaches back to on (the ones behind it went back to the pool)."""
    full = -(-length // block_size)
    return sum(full if window is None else full - max(0, length - window) // block_size for window in group_windows)
