"""`lfu`: as `lru`, but evict the least frequently used expert (ties: least recently used)."""
from __future__ import annotations

from .lru import LRUPolicy


class LFUPolicy(LRUPolicy):
    name = "lfu"

    def setup(self, ctx):
        super().setup(ctx)
        self.uses = {layer: {} for layer in ctx.layers}      # layer -> expert -> forwards that used it

    def used(self, layer, demand):
        super().used(layer, demand)
        uses = self.uses[layer]
        for e in demand:
            uses[e] = uses.get(e, 0) + 1

    def eviction_key(self, layer):
        uses, last = self.uses[layer], self.last_use[layer]
        return lambda e: (uses.get(e, 0), last.get(e, -1), e)
