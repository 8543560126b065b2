"""`lfu`: as `lru`, but evict the least frequently used expert (ties: least recently used)."""
from __future__ import annotations

from .lru import LRUPolicy


class LFUPolicy(LRUPolicy):
    name = "lfu"

    def setup(self, ctx):
        super().setup(ctx)
        self.uses = {layer: {} for layer in ctx.layers}      # layer -> expert -> forwards that used it

    def on_access(self, layer, demand):
        super().on_access(layer, demand)
        uses = self.uses[layer]
        for e in demand:
            uses[e] = uses.get(e, 0) + 1

    def victim(self, layer, candidates):
        uses, last = self.uses[layer], self.last_use[layer]
        return min(candidates, key=lambda e: (uses.get(e, 0), last.get(e, -1), e))
