"""`oled trace --report TRACE --forced`: which part of a policy's PCIe traffic no policy can avoid. In a forward, a
layer that routes to U distinct experts with S slots must bring at least U - S of them from host memory (or compute
them off the GPU), whatever it keeps: those are the *forced* misses. Everything else a policy moves is a matter of
when: an expert needed now that a slot could have held. Per budget: the slots a layer gets (as the engine sizes
them), the distinct experts a layer and iteration, the forced misses and their bytes per iteration at the trace's
expert size (or --expert-mib), and belady's misses in the same replay (Belady's MIN with bypass as a runtime policy:
at least the forced misses), both in GB per iteration. Counts only, no timing.
"""
from __future__ import annotations

import numpy as np

from ..runtime.budget import parse_budget
from .format import KINDS, Trace
from .replay import replay_manager


def forced_misses(trace: Trace, budget: str, expert_bytes: int) -> dict:
    """The forced misses of the trace's denoising iterations at `budget`, and belady's misses, per iteration."""
    model = trace.header["model"]
    slots = parse_budget(budget, num_layers=len(model["moe_layers"]), num_experts=model["num_experts"],
                         expert_bytes=model["expert_bytes"]).slots_per_layer
    iteration = KINDS.index("iteration")
    forced = {}                                   # forward -> forced misses over its layers
    unique = []
    for run in range(len(trace.run_layer)):
        forward = int(trace.run_forward[run])
        if trace.fwd_kind[forward] != iteration:
            continue
        ids = trace.run_ids(run)
        distinct = len(np.unique(ids[ids >= 0]))
        unique.append(distinct)
        forced[forward] = forced.get(forward, 0) + max(0, distinct - slots)
    iterations = max(len(forced), 1)
    belady = replay_manager(trace, "belady", budget)
    belady.replay()
    misses = belady.stats.summary()["misses_per_iteration"]
    per_iter = sum(forced.values()) / iterations
    return {"budget": budget, "slots_per_layer": slots, "iterations": len(forced),
            "unique_experts_per_layer_iteration": float(np.mean(unique)) if unique else 0.0,
            "forced_misses_per_iteration": per_iter, "forced_gb_per_iteration": per_iter * expert_bytes / 1e9,
            "iterations_with_forced_misses": sum(1 for v in forced.values() if v),
            "belady_misses_per_iteration": misses, "belady_gb_per_iteration": misses * expert_bytes / 1e9}


def rows(trace: Trace, policy: None, budget: str, opts) -> list[dict]:
    return [forced_misses(trace, budget, opts.expert_bytes)]
