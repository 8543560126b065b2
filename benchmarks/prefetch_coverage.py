"""How far copying a layer's predicted misses beside the previous layer's compute could go, replayed from a trace on
the CPU: on the mapped path a miss is read from host memory inside its layer, in series with the compute; the
prediction a trace records for a layer (its router applied to the previous layer's input) is known one layer
earlier. Per (policy, budget): the misses of the mapped iterations, the share the prediction names, and how many of
the experts it names that are not resident the layer then does not need (a prefetch of every named expert would
copy those for nothing). Counts only, no timing.

    python benchmarks/prefetch_coverage.py benchmarks/traces/proxy-chat.trace --budgets 0.6,0.4,0.25 \
        --policies oled,lru --capture-slots 16 --costs benchmarks/results/h200/s26/call3/routing-grid/results.jsonl.gz
"""
from __future__ import annotations

import argparse
import json

from oled.kernels.triton_moe import mapped_rows
from oled.trace import Trace, selection
from oled.trace.replay import replay_manager


def coverage(trace: Trace, policy: str, budget: str, costs, capture_slots: int) -> dict:
    mgr = replay_manager(trace, policy, budget, costs, mapped_rows=mapped_rows(True), capture_slots=capture_slots)
    counts = {"misses": 0, "named": 0, "named_not_resident": 0, "named_not_needed": 0, "layers": 0}

    def before_mapped(run: int, layer: int, ids) -> None:
        if run == 0 or trace.run_forward[run - 1] != trace.run_forward[run]:
            return                              # a forward's first MoE layer: nothing predicts it
        pred = trace.run_pred(run - 1)
        if pred is None:
            return
        resident = mgr.cache.resident(layer).keys()
        need, named = set(ids.reshape(-1).tolist()), set(pred.reshape(-1).tolist())
        misses, fetch = need - resident, named - resident
        counts["layers"] += 1
        counts["misses"] += len(misses)
        counts["named"] += len(misses & named)
        counts["named_not_resident"] += len(fetch)
        counts["named_not_needed"] += len(fetch - need)

    mgr.replay(before_mapped)
    return {"policy": policy, "budget": budget, "capture_slots": capture_slots, **counts,
            "named_fraction": counts["named"] / max(counts["misses"], 1),
            "wasted_fraction": counts["named_not_needed"] / max(counts["named_not_resident"], 1),
            "misses_per_layer": counts["misses"] / max(counts["layers"], 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    selection.add_replay_args(ap, policies="oled,lru", expert_mib=False)
    args = ap.parse_args(argv)
    trace = selection.selected_trace(args.trace, args.requests)
    if not trace.has_predictions:
        ap.error(f"{args.trace} records no predictions (record it with a policy that wants them)")
    costs = selection.replay_costs(args.costs)
    for budget in args.budgets.split(","):
        for policy in args.policies.split(","):
            print(json.dumps(coverage(trace, policy, budget, costs, args.capture_slots)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
