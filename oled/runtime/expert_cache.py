"""ExpertCache: a fixed pool of GPU slots and per-layer slot tables.

The pool is allocated once, sized from the budget, so residency can never exceed it; the tables are plain Python,
with their array form kept beside them (`table`). Layer i owns slots [i*C, (i+1)*C): each MoE layer has its own slot
table, as in per-layer expert caches.
"""
from __future__ import annotations

import numpy as np
import torch

from .budget import ExpertBudget


class ExpertCache:
    def __init__(self, layers: list[int], budget: ExpertBudget, numel: int, dtype: torch.dtype, device,
                 num_experts: int):
        self.layers = layers
        self.capacity = budget.slots_per_layer
        self.budget = budget
        self.pool = torch.empty(budget.slots, numel, dtype=dtype, device=device)
        self.slot_of: dict[int, dict[int, int]] = {layer: {} for layer in layers}   # layer -> expert -> slot
        self.free: dict[int, list[int]] = {
            layer: list(range((i + 1) * self.capacity - 1, i * self.capacity - 1, -1)) for i, layer in enumerate(layers)}
        self.evictions = {layer: 0 for layer in layers}
        # layer -> a count of its slot-table changes: a view of the residents made at one version stays valid
        # while the version does (Residency.residents), whoever changes the table
        self.version = {layer: 0 for layer in layers}
        # the slot tables as one array, [layer position, expert] -> slot (-1: not resident), changed with them: the
        # device slot map is written from it without walking the tables (ExpertManager._settle_slots)
        self.pos = {layer: i for i, layer in enumerate(layers)}
        self.table = np.full((len(layers), num_experts), -1, dtype=np.int64)

    def resident(self, layer: int) -> dict[int, int]:
        return self.slot_of[layer]

    def has_free_slot(self, layer: int) -> bool:
        return bool(self.free[layer])

    def insert(self, layer: int, expert: int) -> int:
        """Take a free slot of `layer` for `expert`; the caller copies the weights into it."""
        assert expert not in self.slot_of[layer], (layer, expert)
        slot = self.free[layer].pop()
        self.slot_of[layer][expert] = slot
        self.table[self.pos[layer], expert] = slot
        self.version[layer] += 1
        assert len(self.slot_of[layer]) <= self.capacity
        return slot

    def insert_at(self, layer: int, expert: int, slot: int) -> None:
        """Make `expert` resident in free slot `slot` of `layer`, whose weights are there already (a capture)."""
        assert expert not in self.slot_of[layer], (layer, expert)
        self.free[layer].remove(slot)
        self.slot_of[layer][expert] = slot
        self.table[self.pos[layer], expert] = slot
        self.version[layer] += 1

    def evict(self, layer: int, expert: int) -> int:
        slot = self.slot_of[layer].pop(expert)
        self.table[self.pos[layer], expert] = -1
        self.free[layer].append(slot)
        self.evictions[layer] += 1
        self.version[layer] += 1
        return slot

    @property
    def resident_bytes(self) -> int:
        return sum(map(len, self.slot_of.values())) * self.budget.expert_bytes
