"""Cooperative miss planning: split a layer's misses into experts to load (copy + GPU) and experts to compute on
the CPU. One objective, `plan_costs`, used by the search and by the tests:

    gpu(L) = load(|L|) * copy_slowdown_if_cpu_work + sum(gpu_expert(tokens[e]) for e in L)
    cpu(C) = (cpu_call + sum(cpu_expert(tokens[e]) for e in C)) * cpu_slowdown_if_copying
             + transfer(rows, pairs of C)                                              (0 if C is empty)
    cost(L) = max(gpu(L), cpu(C))  -  sum(credit[e] for e in L)  +  sum(evict_loss[:|L| - free_slots])

Both sides count from the decision on. The layer's hits are not in it: the runtime computes them from the device
slot map while the host waits for the routing and decides (manager.py), so by the time the copies and the CPU job
start the hits' compute is about done; counting it, the planner took CPU jobs for free that ran past it.
credit[e] is what loading e now is predicted to save later (its reuse); evict_loss[i] what the i-th eviction a
load causes is predicted to lose (loads into free slots evict nothing). Constraints: min(free slots, misses) <= |L|
<= max_loads: a free slot is never left empty while a miss goes to the CPU, and loads stay within the slots not
holding a hit (one wave), or any number (max_loads None: further waves reuse slots, their copies serialised on the
copy engine like the first's, which the copy term already counts).

The search is exact for up to EXACT_MAX misses (every subset, vectorised); beyond that it evaluates every split of
three orders (by CPU-side time, by CPU-side time + credit, by credit), which is exact without credits when the GPU
time per expert does not depend on its tokens. Before any search, a bound: when loading every miss beats the least
any split with CPU work can cost, every miss loads (no candidate is evaluated). Plain NumPy over host numbers.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..policies.contract import PlanInputs
from ..policies.costs import CostModel

EXACT_MAX = 8     # 2**8 candidate sets: tens of µs per layer


@dataclass(frozen=True)
class Candidates:
    """Candidate splits of n misses and what the objective needs of them, made once per candidate set (the exact
    search's sets are cached per n): masks [S, n] (True: load experts[j]), as floats for the sums, and counts."""
    masks: np.ndarray
    load: np.ndarray            # [S, n] 1.0 where loaded
    cpu: np.ndarray             # [S, n] 1.0 where computed on the CPU
    n_load: np.ndarray          # [S]
    mixed: np.ndarray           # [S] 1.0 where the split has both loads and CPU work
    has_cpu: np.ndarray         # [S] bool

    @classmethod
    def of(cls, masks: np.ndarray) -> "Candidates":
        masks = np.asarray(masks, dtype=bool)
        n_load = masks.sum(axis=1)
        has_cpu = n_load < masks.shape[1]
        arrays = (masks, masks.astype(np.float64), (~masks).astype(np.float64), n_load,
                  (has_cpu & (n_load > 0)).astype(np.float64), has_cpu)
        for a in arrays:
            a.flags.writeable = False
        return cls(*arrays)


def plan_costs(masks, experts: list[int], inputs: PlanInputs, cost: CostModel) -> np.ndarray:
    """The objective of each candidate split: masks [S, n] bool, True = load experts[j] (or their Candidates).
    Returns [S] seconds."""
    n = len(experts)
    cand = masks if isinstance(masks, Candidates) else Candidates.of(np.asarray(masks, dtype=bool).reshape(-1, n))
    tok = np.array([inputs.tokens[e] for e in experts], dtype=np.int64)
    cpu_t = cost.cpu_expert_seconds_of(tok)
    gpu_t = cost.gpu_expert_seconds_of(tok)
    # the copies, slowed while the CPU works, and the loads' compute; the CPU side: the call and its experts,
    # slowed beside copies, and the activations' round trip (0 where nothing runs on the CPU)
    gpu_side = cost.load_seconds(cand.n_load) * (1.0 + (cost.copy_slowdown_with_cpu - 1.0) * cand.has_cpu) \
        + cand.load @ gpu_t
    cpu_side = (cost.cpu_call_seconds + cand.cpu @ cpu_t) * (1.0 + (cost.cpu_slowdown_with_copies - 1.0) * cand.mixed) \
        + cost.cpu_transfer_seconds(inputs.rows, cand.cpu @ tok)
    objective = np.maximum(gpu_side, np.where(cand.has_cpu, cpu_side, 0.0))
    if inputs.credit:
        objective -= cand.load @ np.array([inputs.credit.get(e, 0.0) for e in experts])
    if inputs.evict_loss:
        loss = np.concatenate([[0.0], np.cumsum(inputs.evict_loss)])
        objective += loss[np.minimum(np.maximum(cand.n_load - max(inputs.free_slots, 0), 0), len(loss) - 1)]
    return objective


def plan_cost(load: list[int], cpu: list[int], inputs: PlanInputs, cost: CostModel) -> float:
    """The objective of one split (for tests and reports)."""
    experts = list(load) + list(cpu)
    mask = np.array([[True] * len(load) + [False] * len(cpu)])
    return float(plan_costs(mask, experts, inputs, cost)[0])


@functools.cache
def _every_subset(n: int) -> Candidates:
    """Every split of n misses: row i loads expert j where bit j of i is set (made once per n, never written)."""
    return Candidates.of((np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1 == 1)


def _candidates(experts: list[int], inputs: PlanInputs, cost: CostModel) -> Candidates:
    n = len(experts)
    if n <= EXACT_MAX:
        return _every_subset(n)
    # what an expert adds to the CPU side of a split with loads: its kernel time, slowed beside copies, and its
    # outputs' way back
    tok = np.fromiter((inputs.tokens[e] for e in experts), dtype=np.int64, count=n)
    cpu_t = cost.cpu_expert_seconds_of(tok) * cost.cpu_slowdown_with_copies \
        + cost.cpu_transfer_seconds(0, tok) - cost.transfer_seconds
    credit = np.array([inputs.credit.get(e, 0.0) for e in experts])
    ids = np.array(experts)
    # orders, most worth loading first (np.lexsort: last key first; ties by lower id)
    orders = [np.lexsort((ids, -cpu_t)), np.lexsort((ids, -(cpu_t + credit))), np.lexsort((ids, -cpu_t, -credit))]
    masks = np.zeros((len(orders) * (n + 1), n), dtype=bool)
    for i, order in enumerate(orders):   # every prefix of the order: its first k experts loaded
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        masks[i * (n + 1):(i + 1) * (n + 1)] = rank[None, :] < np.arange(n + 1)[:, None]
    return Candidates.of(masks)


def _loading_all_wins(experts: list[int], inputs: PlanInputs, cost: CostModel) -> bool:
    """True when loading every miss costs less than any split with CPU work can (so it is the optimum; scalars only,
    the common case of a few misses whose loads are worth their credit). Loading all costs
    load(n) + gpu(all) + losses - credit(all). A split loading L and computing C != {} costs at least
    cpu(C) - credit(L) (eviction losses are >= 0), where credit(L) = credit(all) - credit(C) and credit(C) is at
    least the least credit of a miss (all of them with no loads); cpu(C) is at least the call, the cheapest expert
    and the fewest tokens' transfer, slowed beside loads, or, with no loads, that of every miss."""
    tok = [inputs.tokens[e] for e in experts]
    cpu_t = [cost.cpu_expert_seconds(t) for t in tok]
    credit = [inputs.credit.get(e, 0.0) for e in experts]
    n = len(experts)
    evictions = max(0, n - max(inputs.free_slots, 0))
    all_loaded = (cost.load_seconds(n) + sum(map(cost.gpu_expert_seconds, tok)) + sum(inputs.evict_loss[:evictions]))
    beside_loads = ((cost.cpu_call_seconds + min(cpu_t)) * cost.cpu_slowdown_with_copies
                    + cost.cpu_transfer_seconds(inputs.rows, min(tok)) + min(credit)) if n > 1 else float("inf")
    all_on_cpu = (cost.cpu_call_seconds + sum(cpu_t) + cost.cpu_transfer_seconds(inputs.rows, sum(tok)) + sum(credit)
                  if inputs.min_loads == 0 else float("inf"))
    return all_loaded < min(beside_loads, all_on_cpu)


def split_misses(inputs: PlanInputs, cost: CostModel) -> tuple[list[int], list[int]]:
    """Returns (load, cpu) minimising plan_costs under the load bounds; ties go to fewer loads, then lower ids."""
    experts = sorted(inputs.tokens)
    if not experts:
        return [], []
    if inputs.min_loads == len(experts):      # every miss fits a free slot: nothing to weigh
        return experts, []
    if inputs.load_cap == 0:                  # no slot may take a load
        return [], experts
    if inputs.load_cap == len(experts) and _loading_all_wins(experts, inputs, cost):
        return experts, []
    cand = _candidates(experts, inputs, cost)
    costs = plan_costs(cand, experts, inputs, cost)
    if inputs.min_loads > 0 or inputs.load_cap < len(experts):
        costs[(cand.n_load < inputs.min_loads) | (cand.n_load > inputs.load_cap)] = np.inf
    best = np.lexsort((cand.n_load, np.round(costs, 15)))[0]
    chosen = cand.masks[best].tolist()
    return [e for e, m in zip(experts, chosen) if m], [e for e, m in zip(experts, chosen) if not m]
