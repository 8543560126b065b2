"""`prefetch`: intra-iteration layer-wise prefetch, the autoregressive offloading systems' approach (MoE-Infinity,
ProMoE, HOBBIT, Mixtral-offloading's speculative loading).

While layer l computes, the manager applies layer l+1's router to layer l's MoE input and hands the prediction to
the policy with layer l's event. We prefetch the predicted experts of l+1 that are not resident, most tokens first,
at most as many as fit next to the predicted experts already resident (so a prefetch never pushes out another
predicted expert). Eviction is LRU, except that while a prediction for a layer is pending (until that layer runs)
its predicted experts are evicted last. Misses of the real routing are loaded on demand, as in `lru`.
"""
from __future__ import annotations

from .base import EvictionOrder, member_mask
from .lru import LRUPolicy


class PrefetchPolicy(LRUPolicy):
    name = "prefetch"
    wants_prediction = True

    def setup(self, ctx):
        super().setup(ctx)
        self.predicted: dict[int, set[int]] = {layer: set() for layer in ctx.layers}   # pending predictions
        self.predictions = 0        # predictions received (for tests and reports)

    def eviction_keys(self, layer):
        keep, last = self.predicted[layer], self.last_use[layer]
        return lambda cand: (last[cand], member_mask(len(last), keep)[cand])

    def decide(self, event):
        self.predicted[event.layer] = set()   # the real routing is known now: the prediction has served its purpose
        decision = super().decide(event)
        if event.predicted is not None:
            nxt, predicted = event.next_layer, event.predicted
            self.predictions += 1
            self.touch(nxt)
            # the `capacity` predicted experts with the most tokens (ties: lower id) are the ones worth holding
            ranked = sorted(predicted, key=lambda e: (-predicted[e], e))[: self.ctx.capacity]
            self.predicted[nxt] = set(ranked)
            decision.prefetch = [e for e in ranked if e not in event.next_resident]
            decision.prefetch_evict = EvictionOrder.by_keys(event.next_resident, self.eviction_keys(nxt),
                                                            decision.prefetch)
        return decision
