"""Cooperative miss planning: split a layer's misses into experts to load (copy + GPU) and experts to compute on
the CPU, minimising the layer's makespan minus a credit for loads that save future misses:

    cost(L) = max(load(|L|) + gpu(hits + |L|),  cpu(misses - L) * slowdown_if_copying)  -  sum(credit[e] for e in L)

where cpu(S) is one kernel call over S: a fixed call time plus each expert's time for its tokens (0 for no expert).

Copies cost the same for every expert, so for a fixed number of loads the best set takes the experts that are
most expensive on the CPU (with no credit this is exact); with credits the planner also tries the orders by credit
and by CPU time + credit and keeps the best split. Plain Python: the inputs are host numbers.
"""
from __future__ import annotations

from .cost_model import CostModel


def plan_cost(load: list[int], cpu: list[int], tokens: dict[int, int], hits: int, cost: CostModel,
              credit: dict[int, float] | None = None) -> float:
    credit = credit or {}
    gpu_side = cost.load_seconds(len(load)) + cost.gpu_seconds_per_expert * (hits + len(load))
    cpu_side = cost.cpu_jobs_seconds(tokens[e] for e in cpu)
    if load and cpu:
        cpu_side *= cost.cpu_slowdown_with_copies
    return max(gpu_side, cpu_side) - sum(credit.get(e, 0.0) for e in load)


def split_misses(tokens: dict[int, int], hits: int, cost: CostModel, credit: dict[int, float] | None = None,
                 max_loads: int | None = None) -> tuple[list[int], list[int]]:
    """tokens: miss expert -> tokens routed to it. Returns (load, cpu). max_loads caps the loads (free slots)."""
    credit = credit or {}
    misses = list(tokens)
    cap = len(misses) if max_loads is None else min(max_loads, len(misses))
    cpu_time = {e: cost.cpu_expert_seconds(tokens[e]) for e in misses}
    orders = [
        sorted(misses, key=lambda e: (-cpu_time[e], e)),
        sorted(misses, key=lambda e: (-(cpu_time[e] + credit.get(e, 0.0)), e)),
        sorted(misses, key=lambda e: (-credit.get(e, 0.0), -cpu_time[e], e)),
    ]
    total_cpu = sum(cpu_time.values())
    best = (float("inf"), [], misses)
    for order in orders:   # prefix sums: every split of one order in O(n)
        removed = gained = 0.0
        for k in range(cap + 1):
            if k:
                removed += cpu_time[order[k - 1]]
                gained += credit.get(order[k - 1], 0.0)
            gpu_side = cost.load_seconds(k) + cost.gpu_seconds_per_expert * (hits + k)
            cpu_side = (total_cpu - removed + (cost.cpu_call_seconds if k < len(misses) else 0.0)) * (
                cost.cpu_slowdown_with_copies if 0 < k < len(misses) else 1.0)
            c = max(gpu_side, cpu_side) - gained
            if c < best[0] - 1e-15:
                best = (c, order[:k], order[k:])
    return list(best[1]), list(best[2])
