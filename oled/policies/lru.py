"""`lru`: a per-layer cache that evicts the least recently used expert (Mixtral-offloading style).

Misses are loaded on demand (`misses=load`, the default: the layer waits for its copies), or, with
`misses=cooperative`, split by the planner (runtime/planner.py) between loading and the CPU on the measured costs,
with no reuse credit: the planner's own baseline. `lfu` and `prefetch` take the same option.

A layer's use counts once the layer is done: it is applied when the layer's next event arrives (or, for prefetch,
when the next layer's order is needed), so an eviction order never ranks the experts of the layer being served by
the use it is serving.
"""
from __future__ import annotations

import numpy as np

from .base import MISS_MODES, EvictionOrder, LayerDecision, LayerEvent, Policy, increasing_ids


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
        # layer -> clock of each expert's last use (-1: never), an array for the eviction order's vectorised keys
        self.last_use = {layer: np.full(ctx.num_experts, -1, dtype=np.int64) for layer in ctx.layers}
        self.pending = {layer: None for layer in ctx.layers}  # layer -> experts of its last event, not yet counted

    def touch(self, layer: int) -> None:
        """Count the layer's last use (see the module docstring)."""
        experts, self.pending[layer] = self.pending[layer], None
        if experts is not None:
            self.clock += 1
            self.used(layer, increasing_ids(experts))

    def used(self, layer: int, experts: np.ndarray) -> None:
        """experts: the distinct experts the layer used, as an int array."""
        self.last_use[layer][experts] = self.clock

    def eviction_keys(self, layer: int):
        """cand (expert ids) -> the sort keys EvictionOrder.by_keys takes: least recently used first."""
        last = self.last_use[layer]
        return lambda cand: (last[cand],)

    def eviction_order(self, layer: int, resident, extra=()) -> EvictionOrder:
        """The layer's residents and `extra` (this layer's loads) by eviction_keys (ties: lower id first); built
        only if a slot must be freed."""
        return EvictionOrder.by_keys(resident, self.eviction_keys(layer), extra)

    def split(self, event: LayerEvent) -> tuple[list[int], list[int]]:
        """(load, cpu) of the layer's misses."""
        if self.uses_cpu:
            return self.cooperative_split(event)
        return event.misses, []

    def decide(self, event):
        layer = event.layer
        self.touch(layer)
        load, cpu = self.split(event)
        self.pending[layer] = event.demand_ids
        return LayerDecision(load=load, cpu=cpu, evict=self.eviction_order(layer, event.resident_ids, load))
