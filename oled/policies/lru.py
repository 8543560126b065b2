"""`lru`: load misses on demand into a per-layer cache, evict the least recently used (Mixtral-offloading style)."""
from __future__ import annotations

from .base import Policy


class LRUPolicy(Policy):
    name = "lru"

    def setup(self, ctx):
        super().setup(ctx)
        self.clock = 0
        self.last_use = {layer: {} for layer in ctx.layers}   # layer -> expert -> clock of its last use

    def on_access(self, layer, demand):
        self.clock += 1
        last = self.last_use[layer]
        for e in demand:
            last[e] = self.clock

    def victim(self, layer, candidates):
        last = self.last_use[layer]
        return min(candidates, key=lambda e: (last.get(e, -1), e))
