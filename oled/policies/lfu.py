"""`lfu`: as `lru`, but evict the least frequently used expert (ties: least recently used)."""
from __future__ import annotations

import numpy as np

from .lru import LRUPolicy


class LFUPolicy(LRUPolicy):
    name = "lfu"

    def setup(self, ctx):
        super().setup(ctx)
        self.uses = {layer: np.zeros(ctx.num_experts, dtype=np.int64) for layer in ctx.layers}   # forwards per expert

    def used(self, layer, experts):
        super().used(layer, experts)
        self.uses[layer][experts] += 1    # (ids distinct)

    def eviction_keys(self, layer):
        uses, last = self.uses[layer], self.last_use[layer]
        return lambda cand: (last[cand], uses[cand])
