"""Which part of a policy's PCIe traffic no policy can avoid, from a trace on the CPU. In a forward, a layer that
routes to U distinct experts with S slots must bring at least U - S of them from host memory (or compute them
off the GPU), whatever it keeps: those are the *forced* misses. Everything else a policy moves is a matter of when:
an expert needed now that a slot could have held. Per budget: the slots a layer gets (as the engine sizes them), the
distinct experts a layer and iteration, the forced misses and their bytes per iteration at the trace's expert size
(or --expert-mib), and belady's misses in the same replay (Belady's MIN with bypass as a runtime policy: at least the
forced misses), both in GB per iteration. Counts only, no timing.

    python benchmarks/forced_misses.py benchmarks/traces/proxy-chat.trace --requests 1 --expert-mib 6 \
        --budgets 0.6,0.4,0.25
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from oled.runtime.budget import parse_budget
from oled.trace import Trace, selection
from oled.trace.format import KINDS
from oled.trace.replay import replay_manager


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--budgets", default="0.6,0.4,0.25")
    selection.add_selection_args(ap)
    args = ap.parse_args(argv)
    trace = selection.selected_trace(args.trace, args.requests)
    size = selection.expert_bytes(args.expert_mib, int(trace.header["model"]["expert_bytes"]))
    for budget in args.budgets.split(","):
        print(json.dumps(forced_misses(trace, budget, size)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
