"""The host-side decisions of the expert manager, with no tensors: slot tables, policy calls, statistics.

Per MoE layer the expert manager asks: which needed experts are resident (hits), how the policy splits the misses
(load or CPU), which waves of loads fit the layer's slots, which residents are evicted, what is prefetched for the
next layer; and it records the layer's statistics. All of that lives here, so that the live manager (which also
copies and computes) and the trace replayer (`oled bench --replay`, no weights, no GPU) run the very same code and
get the same hits, loads, evictions and CPU pairs from the same routing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..policies.base import LayerPlan, Policy, PolicyContext
from .expert_cache import ExpertCache
from .stats import LayerRecord, RunStats


@dataclass
class LayerStep:
    """One MoE layer's decisions in one forward."""
    layer: int
    demand: dict[int, int]      # expert -> tokens routed to it
    hits: list[int]             # needed experts resident when the layer runs
    plan: LayerPlan             # the misses: loaded (plan.load) or computed on the CPU (plan.cpu)
    rec: LayerRecord


@dataclass
class Wave:
    """Experts one grouped computation can serve: `experts` (hits plus `loads`) fit the layer's slots together."""
    loads: list[int]            # experts to copy now, into `slots`
    slots: list[int]
    experts: set[int]


class Residency:
    def __init__(self, cache: ExpertCache, policy: Policy, stats: RunStats, *, num_experts: int, top_k: int,
                 expert_bytes: int, costs=None):
        self.cache, self.policy, self.stats = cache, policy, stats
        self.layers = cache.layers
        self.layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        self.expert_bytes = expert_bytes
        policy.setup(PolicyContext(layers=self.layers, num_experts=num_experts, capacity=cache.capacity,
                                   top_k=top_k, expert_bytes=expert_bytes, costs=costs))
        if policy.static_full and cache.capacity < num_experts:
            raise ValueError(f"policy {policy.name!r} needs every expert resident: use --expert-budget 1.0")

    def place_initial(self) -> list[tuple[int, list[int], list[int]]]:
        """Insert the policy's initial placement; returns (layer, experts, slots) for the caller to fill."""
        placed = []
        for layer in self.layers:
            experts = self.policy.initial_placement(layer)[: self.cache.capacity]
            placed.append((layer, experts, [self.cache.insert(layer, e) for e in experts]))
        return placed

    # --------------------------------------------------------------------------------------------- per layer
    def begin_layer(self, layer: int, flat: np.ndarray) -> LayerStep:
        """flat: the layer's routed expert ids, token-major ([T*k]). Asks the policy for the plan, records stats."""
        experts, counts = np.unique(flat, return_counts=True)
        demand = dict(zip(experts.tolist(), counts.tolist()))
        resident = self.cache.resident(layer)
        hits = [e for e in demand if e in resident]
        misses = [e for e in demand if e not in resident]
        plan = self.policy.plan(layer, demand, set(resident))
        if sorted(plan.load + plan.cpu) != sorted(misses):
            raise RuntimeError(f"policy {self.policy.name!r}: plan must split exactly the misses {misses} "
                               f"into load and cpu, got load={plan.load} cpu={plan.cpu}")
        rec = self.stats.layer(layer)
        rec.pairs, rec.experts, rec.expert_tokens = int(flat.size), len(demand), demand
        rec.experts_hit = len(hits)
        rec.pairs_hit = sum(demand[e] for e in hits)
        rec.experts_cpu = len(plan.cpu)
        rec.pairs_cpu = sum(demand[e] for e in plan.cpu)
        return LayerStep(layer, demand, hits, plan, rec)

    def waves(self, step: LayerStep):
        """Yield the layer's waves: hits plus as many loads as the layer's slots hold; more loads than slots run in
        further waves. The slots of a wave's loads are taken (evicting as the policy says) before it is yielded."""
        layer, rec = step.layer, step.rec
        protected, queue = set(step.hits), list(step.plan.load)
        while True:
            room = self.cache.capacity - len(protected)
            loads, queue = queue[:room], queue[room:]
            slots = self._insert(layer, loads, protected | set(loads))
            rec.bytes_h2d += len(loads) * self.expert_bytes
            rec.loads += len(loads)
            yield Wave(loads, slots, protected | set(loads))
            if not queue:
                break
            protected = set()

    def next_layer(self, layer: int) -> int | None:
        pos = self.layer_pos[layer] + 1
        return self.layers[pos] if pos < len(self.layers) else None

    def prefetch(self, layer: int, predicted: np.ndarray, rec: LayerRecord) -> tuple[list[int], list[int]]:
        """Speculative loads for `layer` from its predicted routing (expert ids); returns (experts, slots) to fill.
        Counted in `rec`, the record of the layer that issues them."""
        experts, counts = np.unique(predicted, return_counts=True)
        resident = self.cache.resident(layer)
        wanted = [e for e in self.policy.prefetch(layer, dict(zip(experts.tolist(), counts.tolist())), set(resident))
                  if e not in resident][: self.cache.capacity]
        slots = self._insert(layer, wanted, set(wanted))
        rec.bytes_h2d += len(wanted) * self.expert_bytes
        rec.prefetches += len(wanted)
        return wanted, slots

    def end_layer(self, step: LayerStep) -> None:
        self.policy.on_access(step.layer, step.demand)
        resident_after = self.cache.resident(step.layer)
        step.rec.resident = len(resident_after)
        step.rec.resident_used = sum(1 for e in step.demand if e in resident_after)

    def record_static(self, layer: int, ids: np.ndarray) -> None:
        """Statistics of a layer under a static all-resident policy (no decisions: every pair is a hit)."""
        experts, counts = np.unique(ids.reshape(-1), return_counts=True)
        rec = self.stats.layer(layer)
        rec.pairs = rec.pairs_hit = int(ids.size)
        rec.experts = rec.experts_hit = rec.resident_used = len(experts)
        rec.resident = self.cache.capacity
        rec.expert_tokens = dict(zip(experts.tolist(), counts.tolist()))

    # ------------------------------------------------------------------------------------------------ slots
    def _insert(self, layer: int, experts: list[int], protected: set[int]) -> list[int]:
        slots = []
        for e in experts:
            self._make_room(layer, protected)
            slots.append(self.cache.insert(layer, e))
        return slots

    def _make_room(self, layer: int, protected: set[int]) -> None:
        if self.cache.has_free_slot(layer):
            return
        candidates = [e for e in self.cache.resident(layer) if e not in protected]
        victim = self.policy.victim(layer, candidates)
        if victim not in candidates:
            raise RuntimeError(f"policy {self.policy.name!r} chose victim {victim} outside the candidates")
        self.cache.evict(layer, victim)
