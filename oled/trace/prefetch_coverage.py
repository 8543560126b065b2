"""`oled trace --report TRACE --coverage`: how far copying a layer's predicted misses beside the previous layer's
compute could go, replayed on the CPU. On the mapped path a miss is read from host memory inside its layer, in series
with the compute; the prediction a trace records for a layer (its router applied to the previous layer's input) is
known one layer earlier. Per (policy, budget): the misses of the mapped iterations, the share the prediction names,
and how many of the experts it names that are not resident the layer then does not need (a prefetch of every named
expert would copy those for nothing). Counts only, no timing.
"""
from __future__ import annotations

from ..kernels.triton_moe import mapped_rows
from .format import Trace
from .replay import replay_manager


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


def rows(trace: Trace, policy: str, budget: str, opts) -> list[dict]:
    if not trace.has_predictions:
        raise ValueError("the trace records no predictions (record it without --no-predictions)")
    return [coverage(trace, policy, budget, opts.costs, opts.capture_slots)]
