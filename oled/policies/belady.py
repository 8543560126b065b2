"""`belady`: clairvoyant retention, for trace replay only: Belady's MIN with bypass. A miss is kept (loaded) only if
its next use is sooner than that of the farthest-used resident the layer does not need (or a slot is free), which it
then evicts; otherwise it is served without a slot (sent to `cpu`: in a replay, a miss not kept). Never evicts what
the current layer needs (the runtime keeps a layer's hits while its loads fit), so it is what a runtime policy could
do knowing the future; the exact fewest misses, where a layer may also drop its own hits, is oled/bounds.py's
`belady` (the `bound:belady-*` rows), which no policy can beat. Expert-weighted: a policy that weighs hits by tokens
can do better on token-weighted hit rate.

The replayer hands it each MoE layer's future demand (`set_future`): per layer, the expert sets of its events in
order; the policy counts its own events per layer to know where it is.
"""
from __future__ import annotations

import bisect

from .base import LayerDecision, Policy

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
        after = {e: self.next_use(layer, e, now) for e in event.misses}
        # the residents the layer does not need, farthest next use first: the victims, in order
        victims = sorted((e for e in event.resident if e not in event.demand),
                         key=lambda e: (-self.next_use(layer, e, now), e))
        free = self.ctx.capacity - len(event.resident)
        load, cpu, taken = [], [], 0
        for e in sorted(event.misses, key=lambda e: (after[e], e)):     # soonest used first
            if after[e] != NEVER and free > 0:
                free -= 1
                load.append(e)
            elif after[e] != NEVER and taken < len(victims) and \
                    self.next_use(layer, victims[taken], now) > after[e]:
                taken += 1
                load.append(e)
            else:
                cpu.append(e)
        return LayerDecision(load=load, cpu=cpu, evict=victims)
