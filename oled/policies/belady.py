"""`belady`: the retention limit, for trace replay only. Every miss is loaded; when a slot is needed, the resident
expert whose next use lies farthest in the future is evicted (never used again: first, lower id first). For a
cache of a given size this minimises the loads (Belady's MIN, which stays optimal when a layer needs a set of
experts at once: the set's members are used now, so none is evicted for another). It bounds expert-weighted hits;
a policy that weighs hits by tokens or serves misses without a slot can do better on token-weighted hit rate.

The replayer hands it each MoE layer's future demand (`set_future`): per layer, the expert sets of its events in
order; the policy counts its own events per layer to know where it is.
"""
from __future__ import annotations

import bisect

from .base import EvictionOrder, LayerDecision, Policy

NEVER = float("inf")


class BeladyPolicy(Policy):
    name = "belady"
    needs_future = True

    def setup(self, ctx):
        super().setup(ctx)
        self.uses: dict[int, dict[int, list[int]]] | None = None    # layer -> expert -> event indices using it
        self.position = {layer: 0 for layer in ctx.layers}          # next event index per layer

    def set_future(self, demand_sets: dict[int, list[set[int]]]) -> None:
        """demand_sets: layer -> the expert sets of that layer's events, in the order they will be decided."""
        self.uses = {}
        for layer, sets in demand_sets.items():
            uses: dict[int, list[int]] = {}
            for i, experts in enumerate(sets):
                for e in experts:
                    uses.setdefault(e, []).append(i)
            self.uses[layer] = uses

    def next_use(self, layer: int, expert: int, after: int) -> float:
        times = self.uses[layer].get(expert)
        if not times:
            return NEVER
        i = bisect.bisect_right(times, after)
        return times[i] if i < len(times) else NEVER

    def decide(self, event):
        if self.uses is None:
            raise RuntimeError("policy 'belady' needs the future: it runs in trace replay only "
                               "(oled bench --replay TRACE --policies belady)")
        layer = event.layer
        now = self.position[layer]
        self.position[layer] = now + 1
        load = event.misses
        candidates = event.resident | set(load)
        return LayerDecision(load=load, evict=EvictionOrder(
            lambda: sorted(candidates, key=lambda e: (-self.next_use(layer, e, now), e))))
