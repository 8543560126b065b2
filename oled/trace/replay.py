"""Replaying a trace through any policy on the CPU: hit rates, loads, CPU pairs and H2D bytes without weights or GPU.

The replayer makes the calls the live ExpertManager makes, in the recorded order, and uses the manager's own
decision code (oled.runtime.residency.Residency: slot tables, plan, waves, evictions, prefetch, statistics) over
an expert cache with no memory behind it, so from the same routing it reaches the same decisions and statistics as
a live run (tests/test_trace.py checks this against `lru`, `lfu` and `prefetch`).

Mapped misses (the live engine's default on CUDA, recorded in the trace's header): a denoising iteration's layers
are decided as the live manager decides them after the forward (Residency.decide_mapped), and on the host round
trip the misses a policy sends to the CPU count as read from host memory (Residency.cpu_on_host).

Prefetch: policies that want predictions get the next layer's predicted routing recorded in the trace (that
layer's router applied to this layer's input, exactly what the live manager computes). A trace recorded without
predictions falls back to the next layer's actual routing of the same forward (an oracle prediction), and says so.
`ReplayManager.predicted(run, ahead)` gives the recorded predictions 1 to 3 MoE layers ahead the same way.
"""
from __future__ import annotations

import numpy as np
import torch

from ..policies import make_policy
from ..policies.base import Policy
from ..runtime.budget import ExpertBudget, parse_budget
from ..policies.costs import CostModel
from ..runtime.expert_cache import ExpertCache
from ..runtime.residency import Residency
from ..runtime.stats import RunStats
from .format import BEGIN, END, EVENT, REQUEST, RUN, Trace


def future_demand(layers, runs) -> dict[int, list[set[int]]]:
    """Per MoE layer, the expert sets of its runs [(layer, ids)] in replay order: what a policy that knows the future
    (belady) is given."""
    sets: dict[int, list[set[int]]] = {layer: [] for layer in layers}
    for layer, ids in runs:
        sets[layer].append(set(ids.reshape(-1).tolist()))
    return sets


def decide_layer(res: Residency, layer: int, ids: np.ndarray, weights: np.ndarray, predicted=None) -> None:
    """One layer's decisions as the live manager's host round trip makes them, with no copies and no compute."""
    step = res.begin_layer(layer, ids, weights, predicted)
    res.cpu_on_host(step)
    for _ in res.waves(step):
        pass
    res.prefetch(step)
    res.end_layer(step)


class ReplayManager:
    def __init__(self, trace: Trace, budget: ExpertBudget, policy: Policy, costs: CostModel | None = None,
                 cpu_scales: np.ndarray | None = None, mapped_rows: int = 0, capture_slots: int = 0,
                 cpu_share: bool = False):
        """cpu_scales: per forward, the scale of the CPU costs to plan on (the recording's, with its cost model);
        mapped_rows, capture_slots: as the live run's Residency (its kernels' block of pairs with mapped misses,
        else 0; the free slots a layer keeps for captured misses; whether mapped layers gave the CPU a share)."""
        model = trace.header["model"]
        self.trace, self.policy, self.budget, self.cpu_scales = trace, policy, budget, cpu_scales
        self.cache = ExpertCache(trace.layers, budget, 1, torch.float32, "meta",    # slot tables only
                                 model["num_experts"])
        self.stats = RunStats()
        self.residency = Residency(self.cache, policy, self.stats, num_experts=model["num_experts"],
                                   top_k=model["top_k"], expert_bytes=model["expert_bytes"], costs=costs,
                                   mapped_rows=mapped_rows, capture_slots=capture_slots, cpu_share=cpu_share)
        self.residency.place_initial()
        if policy.needs_future:
            policy.set_future(future_demand(trace.layers, ((int(layer), trace.run_ids(i))
                                                            for i, layer in enumerate(trace.run_layer))))
        self.prediction = "recorded" if trace.has_predictions else "oracle (next layer's actual routing)"

    def predicted(self, i: int, ahead: int = 1) -> np.ndarray | None:
        """The routing of the MoE layer `ahead` layers after run i's, predicted from run i's input: recorded, else
        that layer's actual routing in the same forward (an oracle); None where there is no such layer."""
        t = self.trace
        pred = t.run_pred(i, ahead)
        if pred is not None:
            return pred
        j = i + ahead      # no recorded prediction: that layer's actual routing in the same forward
        pos = self.residency.layer_pos
        if (j < len(t.run_layer) and t.run_forward[j] == t.run_forward[i]
                and pos[int(t.run_layer[j])] - pos[int(t.run_layer[i])] == ahead):
            return t.run_ids(j)
        return None

    def replay(self, before_mapped=None) -> RunStats:
        """before_mapped(run, layer, ids): called before each layer decided on the mapped path, its residency not yet
        changed (run: the trace's run index; an analysis hook, oled/trace/prefetch_coverage.py)."""
        t, policy, res = self.trace, self.policy, self.residency
        static_log: list[tuple[int, np.ndarray]] = []
        all_resident = res.all_resident           # as the live manager's all-resident path
        forward, mapped = -1, False
        for op, arg in t.ops.tolist():
            if op == RUN:
                layer, ids = int(t.run_layer[arg]), t.run_ids(arg).astype(np.int64)
                if all_resident:
                    static_log.append((layer, ids))
                    continue
                if mapped:                        # as the live manager's mapped path: no prediction
                    if before_mapped is not None:
                        before_mapped(arg, layer, ids)
                    res.decide_mapped(layer, ids, t.run_weights(arg).copy())
                    continue
                predicted = None
                if policy.wants_prediction and res.next_layer(layer) is not None:
                    predicted = self.predicted(arg)
                    predicted = None if predicted is None else predicted.astype(np.int64)
                decide_layer(res, layer, ids, t.run_weights(arg).copy(), predicted)
            elif op == BEGIN:
                forward += 1
                info = t.forward_info(forward)
                if all_resident:
                    res.begin_resident_forward(info)
                    continue
                scale = 1.0 if self.cpu_scales is None else float(self.cpu_scales[forward])
                mapped = res.takes_mapped_path(info)
                res.arm_capture(mapped)
                res.begin_forward(info, cpu_scale=scale)
            elif op == END:
                for layer, ids in static_log:
                    res.record_resident(layer, ids)
                static_log.clear()
            elif op == EVENT and not all_resident:
                policy.on_iteration(t.event(arg))
            elif op == REQUEST:
                policy.on_request_start()
        return self.stats


def replay(trace: Trace, policy: str | Policy, expert_budget, costs: CostModel | None = None,
           mapped_rows: int | None = None, capture_slots: int | None = None, cpu_share: bool | None = None,
           **options) -> ReplayManager:
    """Replay `trace` through a policy (name and make_policy options, or an instance) at a budget. Policies that
    plan misses on measured costs get `costs`, else the cost model of the run that recorded the trace, if any,
    with each forward's CPU scale as recorded (runtime/cpu_feedback.py). mapped_rows: the live engine's
    mapped misses (its kernels' block of pairs; 0: off), capture_slots: its free slots a layer keeps for captured
    misses, cpu_share: its mapped layers' CPU share; None: as the recording ran (its header's "live")."""
    mgr = replay_manager(trace, policy, expert_budget, costs, mapped_rows, capture_slots, cpu_share, **options)
    mgr.replay()
    return mgr


def replay_manager(trace: Trace, policy: str | Policy, expert_budget, costs: CostModel | None = None,
                   mapped_rows: int | None = None, capture_slots: int | None = None, cpu_share: bool | None = None,
                   **options) -> ReplayManager:
    """The ReplayManager that replay() runs, built but not run (to adjust its Residency first)."""
    model = trace.header["model"]
    budget = parse_budget(expert_budget, num_layers=len(trace.layers), num_experts=model["num_experts"],
                          expert_bytes=model["expert_bytes"])
    if isinstance(policy, str):
        policy = make_policy(policy, **options)
    cpu_scales = None
    if costs is None and trace.header.get("costs"):     # the recording's costs, as its forwards planned on them
        costs, cpu_scales = CostModel.from_dict(trace.header["costs"]), trace.fwd_cpu_scale
    live = trace.header.get("live", {})
    if mapped_rows is None:
        mapped_rows = int(live.get("mapped_rows", 0))
    if capture_slots is None:
        capture_slots = int(live.get("capture_slots", 0))
    if cpu_share is None:
        cpu_share = bool(live.get("cpu_share", False))
    return ReplayManager(trace, budget, policy, costs, cpu_scales, mapped_rows, capture_slots, cpu_share)
