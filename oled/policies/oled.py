"""`oled`: confidence-guided inter-iteration retention and reuse-aware cooperative miss handling.

Adjacent denoising iterations of a block route to nearly the same experts, and each position's state and
confidence say whether its routing will repeat (policies/reuse.py). So instead of prefetching the next layer:
  1. Reuse prediction: after each iteration, a score per (layer, expert) from the positions that routed to it,
     each weighted by its calibrated probability of being routed the same way next iteration, with decayed history
     and, at a block boundary, the first-iteration mask routing of the block just done.
  2. Retention (`retention=reuse`): when a slot is needed, evict the resident expert with the lowest score (ties:
     least recently used); the experts the current layer needs go last, and the runtime never evicts one the wave
     being served needs. No speculative loads. `retention=learned` ranks by a linear model of the layer's routing
     history fitted on traces to how soon each expert is used again (policies/retention_model.py;
     `retention_model=FILE` from `oled trace --fit-retention`, else the one shipped).
  3. Cooperative misses (`misses=cooperative`): per layer the planner (runtime/planner.py) splits the misses
     between loading and the CPU, minimising the layer's makespan minus the reuse credit of each load, plus the
     predicted value of what each load evicts. With p = P(some position routed to the miss now routes to it next
     iteration), its credit is the iterations it is expected to keep being reused, min(p / (1 - p), horizon), times
     what a hit then saves (the cheaper of a load and its CPU time); a resident's value is the same with
     p = 1 - exp(-score).
Variants (the ablations): `oled` = reuse retention + cooperative misses; `oled-retain` = reuse retention, every
miss loaded; `oled-coop` = LRU retention + reuse-aware cooperative misses. `waves=1` lets the planner load misses
beyond the slots not holding a hit, in further waves, instead of sending every such miss to the CPU (off by
default: docs/decisions.md, one-wave).
"""
from __future__ import annotations

import math
from itertools import islice

import numpy as np

from .base import EvictionOrder, LayerDecision, LayerEvent, member_mask
from .lru import LRUPolicy
from .retention_model import RetentionFeatures, RetentionModel
from .reuse import WEIGHTINGS, ReuseCalibration, ReusePredictor

RETENTIONS = ("reuse", "lru", "learned")


class OledPolicy(LRUPolicy):
    name = "oled"
    options = ("misses", "retention", "decay", "weighting", "calibration", "horizon", "waves", "retention_model")

    def __init__(self, misses: str = "cooperative", retention: str = "reuse", decay: float = 0.0,
                 weighting: str = "count", calibration=None, horizon: float = 8.0, waves=0, retention_model=None):
        super().__init__(misses=misses)
        if retention not in RETENTIONS:
            raise ValueError(f"policy {self.name!r}: retention must be one of {', '.join(RETENTIONS)}, "
                             f"got {retention!r}")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"policy {self.name!r}: weighting must be one of {', '.join(WEIGHTINGS)}, "
                             f"got {weighting!r}")
        decay = float(decay)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"policy {self.name!r}: decay must be in [0, 1), got {decay!r}")
        horizon = float(horizon)
        if not horizon > 0:
            raise ValueError(f"policy {self.name!r}: horizon (iterations a retained expert is valued over) must be "
                             f"positive, got {horizon!r}")
        if str(waves) not in ("0", "1", "False", "True"):
            raise ValueError(f"policy {self.name!r}: waves must be 0 (misses beyond the slots not holding a hit go to "
                             f"the CPU) or 1 (they may load in further waves), got {waves!r}")
        self.retention, self.decay, self.weighting, self.horizon = retention, decay, weighting, horizon
        self.waves = str(waves) in ("1", "True")
        self.calibration = ReuseCalibration.load(calibration)
        self.retention_model = RetentionModel.load(retention_model) if retention == "learned" else None

    def setup(self, ctx):
        super().setup(ctx)
        self.predictor = ReusePredictor(ctx.layers, ctx.num_experts, self.calibration, decay=self.decay,
                                        weighting=self.weighting)
        self.features = (RetentionFeatures(ctx.layers, ctx.num_experts) if self.retention_model is not None
                         else None)
        self.requests = 0           # the block key of the learned retention's features: (request, block start)
        self.block_start = 0

    # ------------------------------------------------------------------------------------------------ events
    def on_request_start(self):
        super().on_request_start()
        self.predictor.reset()
        self.requests += 1
        if self.features is not None:
            self.features.reset()

    def on_forward(self, info):
        self.predictor.on_forward(info)
        self.block_start = info.block_start

    def on_iteration(self, event):
        super().on_iteration(event)
        self.predictor.on_iteration(event)

    def decide(self, event: LayerEvent) -> LayerDecision:
        layer = event.layer
        self.touch(layer)
        self.predictor.observe(layer, event.ids, event.weights)
        if self.features is not None:
            tokens = np.bincount(event.ids.reshape(-1), minlength=self.ctx.num_experts)[event.demand_ids]
            self.features.observe(layer, event.demand_ids, tokens, (self.requests, self.block_start))
        # one order for the planner's eviction losses and the runtime's evictions (misses sent to the CPU are never
        # resident, so listing them too changes nothing)
        order = self.eviction_order(layer, event.resident_ids, event.misses, needed=event.demand_ids)
        load, cpu = self.split(event, order)
        self.pending[layer] = event.demand_ids
        return LayerDecision(load=load, cpu=cpu, evict=order)

    # ------------------------------------------------------------------------------------------------ retention
    def eviction_order(self, layer, resident, extra=(), needed=()):
        """By (needed now, score, last use, id); needed: the layer's routed ids (or any collection of experts)."""
        if self.retention == "lru":
            return super().eviction_order(layer, resident, extra)
        last = self.last_use[layer]
        if self.retention == "learned":     # the model's score of the layer's experts, computed when a slot is needed
            return EvictionOrder.by_keys(resident, lambda cand: (
                last[cand], self.retention_model.score(self.features.matrix(layer))[cand],
                member_mask(len(last), needed)[cand]), extra)
        score = self.predictor.layer_scores(layer)
        return EvictionOrder.by_keys(
            resident, lambda cand: (last[cand], score[cand], member_mask(len(last), needed)[cand]), extra)

    # ------------------------------------------------------------------------------------------------ misses
    def split(self, event, order=()):
        """(load, cpu) of the layer's misses; `order` is the layer's eviction order (for the eviction losses)."""
        if self.misses == "load":
            return event.misses, []
        misses = event.misses
        if not misses:
            return [], []
        if event.misses_served:   # nothing to weigh (cooperative_split loads them all)
            return self.cooperative_split(event)
        costs = self.costs
        # P(no row routed to e now routes to it next iteration) = prod over those rows of (1 - p): one bincount of
        # log(1 - p) over every (row, expert) pair (a row routes to an expert at most once)
        k = event.ids.shape[1]
        log_keep = self.predictor.log_keep(len(event.ids))
        none_reused = np.exp(np.bincount(event.ids.reshape(-1), weights=np.repeat(log_keep, k),
                                         minlength=self.ctx.num_experts))
        credit = {e: self.future_uses(1.0 - float(none_reused[e])) * self._saving(costs, event.demand[e])
                  for e in misses}
        free = self.ctx.capacity - len(event.resident)
        extra = max(0, len(misses) - max(free, 0))
        loss = []
        if extra:
            # evicted first: residents this layer does not need; with waves, then its own hits once computed (the
            # order's first `extra` of each kind: no walk through the whole order)
            resident, demand = event.resident, event.demand
            victims = list(islice((e for e in order if e in resident and e not in demand), extra))
            if self.waves and len(victims) < extra:
                victims += islice((e for e in order if e in resident and e in demand), extra - len(victims))
            score = self.predictor.layer_scores(event.layer)
            saving = self._saving(costs, max(1, round(event.ids.size / max(len(demand), 1))))   # a typical expert's
            loss = [self.future_uses(1.0 - math.exp(-s)) * saving for s in score[victims].tolist()]
        return self.cooperative_split(event, credit=credit, evict_loss=loss, waves=self.waves)

    def future_uses(self, p: float) -> float:
        """Expected iterations an expert reused next iteration with probability p keeps being reused, if each next
        one repeats with p too (p / (1 - p)), at most the horizon (a block runs a handful of iterations)."""
        return self.horizon if p >= 1.0 else min(p / (1.0 - p), self.horizon)

    @staticmethod
    def _saving(costs, tokens: int) -> float:
        """What a hit saves over serving the expert as a miss: the cheaper of a load and its CPU time."""
        return min(costs.load_seconds(1), costs.cpu_expert_seconds(tokens))
