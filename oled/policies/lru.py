"""`lru`: a per-layer cache that evicts the least recently used expert (Mixtral-offloading style).

Misses are loaded on demand (`misses=load`, the default: the layer waits for its copies), or, with
`misses=cooperative`, split by the planner (runtime/planner.py) between loading and the CPU on the measured costs:
the "cooperative only, LRU retention" configuration. `lfu` and `prefetch` take the same option.
"""
from __future__ import annotations

from .base import MISS_MODES, Policy


class LRUPolicy(Policy):
    name = "lru"
    options = ("misses",)

    def __init__(self, misses: str = "load"):
        if misses not in MISS_MODES:
            raise ValueError(f"policy {self.name!r}: misses must be one of {', '.join(MISS_MODES)}, got {misses!r}")
        self.misses = misses
        self.uses_cpu = misses == "cooperative"

    def setup(self, ctx):
        super().setup(ctx)
        if self.uses_cpu and ctx.costs is None:
            raise ValueError(f"policy {self.name!r} with misses=cooperative needs the measured cost model "
                             "(the engine measures it; a trace replay takes the recording's or --cost-model FILE)")
        self.clock = 0
        self.last_use = {layer: {} for layer in ctx.layers}   # layer -> expert -> clock of its last use

    def plan(self, layer, demand, resident):
        if self.uses_cpu:
            return self.cooperative_plan(demand, resident)
        return super().plan(layer, demand, resident)

    def on_access(self, layer, demand):
        self.clock += 1
        last = self.last_use[layer]
        for e in demand:
            last[e] = self.clock

    def victim(self, layer, candidates):
        last = self.last_use[layer]
        return min(candidates, key=lambda e: (last.get(e, -1), e))
