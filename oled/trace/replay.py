"""Replaying a trace through any policy on the CPU: hit rates, loads, CPU pairs and H2D bytes without weights or GPU.

The replayer makes the calls the live ExpertManager makes, in the recorded order, and uses the manager's own
decision code (oled.runtime.residency.Residency: slot tables, plan, waves, evictions, prefetch, statistics) over
an expert cache with no memory behind it, so from the same routing it reaches the same decisions and statistics as
a live run (tests/test_trace.py checks this against `lru`, `lfu` and `prefetch`).

Prefetch: policies that want predictions get the next layer's predicted routing recorded in the trace (that
layer's router applied to this layer's input, exactly what the live manager computes). A trace recorded without
predictions falls back to the next layer's actual routing of the same forward (an oracle prediction), and says so.
"""
from __future__ import annotations

import numpy as np
import torch

from ..policies import make_policy
from ..policies.base import Policy
from ..runtime.budget import ExpertBudget, parse_budget
from ..runtime.cost_model import CostModel
from ..runtime.expert_cache import ExpertCache
from ..runtime.residency import Residency
from ..runtime.stats import RunStats
from .format import BEGIN, END, EVENT, KINDS, REQUEST, RUN, Trace


class ReplayManager:
    def __init__(self, trace: Trace, budget: ExpertBudget, policy: Policy, costs: CostModel | None = None):
        model = trace.header["model"]
        self.trace, self.policy, self.budget = trace, policy, budget
        self.cache = ExpertCache(trace.layers, budget, 1, torch.float32, "meta")   # slot tables only
        self.stats = RunStats()
        self.residency = Residency(self.cache, policy, self.stats, num_experts=model["num_experts"],
                                   top_k=model["top_k"], expert_bytes=model["expert_bytes"], costs=costs)
        self.residency.place_initial()
        self.prediction = "recorded" if trace.has_predictions else "oracle (next layer's actual routing)"

    def _predicted(self, i: int, nxt: int) -> np.ndarray | None:
        t = self.trace
        pred = t.run_pred(i)
        if pred is not None:
            return pred.reshape(-1)
        j = i + 1      # no recorded prediction: the next layer's actual routing in the same forward
        if j < len(t.run_layer) and t.run_forward[j] == t.run_forward[i] and t.run_layer[j] == nxt:
            return t.run_ids(j).reshape(-1)
        return None

    def replay(self) -> RunStats:
        t, policy, res = self.trace, self.policy, self.residency
        static_log: list[tuple[int, np.ndarray]] = []
        for op, arg in t.ops.tolist():
            if op == RUN:
                layer, ids = int(t.run_layer[arg]), t.run_ids(arg).astype(np.int64)
                if policy.static_full:
                    static_log.append((layer, ids))
                    continue
                step = res.begin_layer(layer, ids.reshape(-1))
                for _ in res.waves(step):
                    pass
                if policy.wants_prediction:
                    nxt = res.next_layer(layer)
                    if nxt is not None:
                        predicted = self._predicted(arg, nxt)
                        if predicted is not None:
                            res.prefetch(nxt, predicted.astype(np.int64), step.rec)
                res.end_layer(step)
            elif op == BEGIN:
                self.stats.begin_forward(KINDS[arg])
            elif op == END:
                for layer, ids in static_log:
                    res.record_static(layer, ids)
                static_log.clear()
            elif op == EVENT:
                policy.on_iteration(t.event(arg))
            elif op == REQUEST:
                policy.on_request_start()
        return self.stats


def replay(trace: Trace, policy: str | Policy, expert_budget, costs: CostModel | None = None,
           **options) -> ReplayManager:
    """Replay `trace` through a policy (name and make_policy options, or an instance) at a budget. Policies that
    plan misses on measured costs get `costs`, else the cost model of the run that recorded the trace, if any."""
    model = trace.header["model"]
    budget = parse_budget(expert_budget, num_layers=len(trace.layers), num_experts=model["num_experts"],
                          expert_bytes=model["expert_bytes"])
    if isinstance(policy, str):
        policy = make_policy(policy, **options)
    if costs is None and trace.header.get("costs"):
        costs = CostModel.from_dict(trace.header["costs"])
    mgr = ReplayManager(trace, budget, policy, costs)
    mgr.replay()
    return mgr
