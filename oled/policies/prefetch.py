"""`prefetch`: intra-iteration layer-wise prefetch, the autoregressive offloading systems' approach (MoE-Infinity,
ProMoE, HOBBIT, Mixtral-offloading's speculative loading).

While layer l computes, the manager applies layer l+1's router to layer l's MoE input (`manager.predictors`) and
asks `prefetch(l+1, predicted, resident)` which experts to copy ahead on the copy stream. We prefetch the
predicted experts of l+1 that are not resident, most tokens first, at most as many as fit next to the predicted
experts already resident (so a prefetch never pushes out another predicted expert). Eviction is LRU, except that
while a prediction for a layer is pending (until that layer runs) its predicted experts are evicted last.
Misses of the real routing are loaded on demand, as in `lru`.
"""
from __future__ import annotations

from .lru import LRUPolicy


class PrefetchPolicy(LRUPolicy):
    name = "prefetch"
    wants_prediction = True

    def setup(self, ctx):
        super().setup(ctx)
        self.predicted: dict[int, set[int]] = {layer: set() for layer in ctx.layers}   # pending predictions
        self.predictions = 0        # prefetch() calls (for tests and reports)

    def prefetch(self, layer, predicted, resident):
        self.predictions += 1
        # the `capacity` predicted experts with the most tokens (ties: lower id) are the ones worth holding
        ranked = sorted(predicted, key=lambda e: (-predicted[e], e))[: self.ctx.capacity]
        self.predicted[layer] = set(ranked)
        return [e for e in ranked if e not in resident]

    def plan(self, layer, demand, resident):
        self.predicted[layer] = set()     # the real routing is known now: the prediction has served its purpose
        return super().plan(layer, demand, resident)

    def victim(self, layer, candidates):
        keep, last = self.predicted[layer], self.last_use[layer]
        return min(candidates, key=lambda e: (e in keep, last.get(e, -1), e))
