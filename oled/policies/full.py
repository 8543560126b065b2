"""`full`: every routed expert resident on the GPU (budget 100 %). The upper bound, on the same code path."""
from __future__ import annotations

from .base import Policy


class FullPolicy(Policy):
    name = "full"
    static_full = True

    def initial_placement(self, layer: int) -> list[int]:
        return list(range(self.ctx.num_experts))

    def decide(self, event):
        raise RuntimeError("policy 'full' needs every expert resident: use --expert-budget 1.0")
