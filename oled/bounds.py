"""Bounds from a routing trace: the fewest misses any retention can make, and what serving the misses would take
at best on a machine's costs. The `bound:*` rows of `oled bench` grids. Plain Python and NumPy (no tensors).

The demand is the sequence of MoE layer runs of a trace, in order: per run its layer, the experts it needs (with the
tokens routed to each and the layer's input rows) and whether it is timed (a denoising iteration; prefills and cache
fills are not: they are neither timed nor counted, and may load what they need for free, as their misses are not in
the iteration statistics either). A *pool* holds slots: one per MoE layer with the budget split evenly across
layers (`even`), or one for all MoE layers with the same total slots (`shared`).

Misses (what `belady` minimises): expert-weighted misses per MoE layer per iteration: the experts a timed run needs
that are not resident when it runs, summed over layers, per iteration. After a run the pool may hold any `slots` of
(what was resident) + (what the run needed): a miss may be served without being kept (bypass), and the run's own
experts may be dropped. This is a relaxation of every runtime (whose waves keep a layer's hits while its loads fit),
so its optimum bounds every policy. It is Belady's MIN with bypass: the run's requests are taken hits first, then
misses, each kept only if its next timed use is sooner than the farthest resident's (an expert whose next use is
untimed or never has none: it is reloaded free there). That is optimal for single requests, and a run of hits then
misses makes every transition of the set problem reachable at the same cost (tests: brute force over every choice).

Time (ms per token: the timed runs' time / the generated tokens). A timed run of layer l costs `compute[l]` (full's
forward split over the MoE layers) and its misses are served inside it, beside that compute:

    T(L, C) = max(compute, link(L), cpu(C))        L: misses over the link, C: misses computed on the CPU
    link(L) = |L| * link_s * (copy_slowdown_with_cpu if C else 1)
    cpu(C)  = (cpu_call_s + sum cpu_expert_s[tokens[e]]) * (cpu_slowdown_with_copies if L else 1)
              + transfer_s + rows * row_s + sum(tokens[e]) * pair_s                      (0 if C is empty)

which is the planner's objective (oled/runtime/planner.py) with the loads' GPU compute inside `compute`, no credit
and no eviction loss. `demand-link`: every miss of the belady schedule over the link; `demand-coop`: the misses the
schedule keeps over the link (they take a slot), the others split between link and CPU at the split minimising T.
These are the times of the miss-optimal schedule: achievable with clairvoyance, but not proven time-optimal (a
schedule with more misses, placed where the link hides under compute, can be faster). `floor` is a valid lower bound
on every link-only schedule, demand or prefetch: max(sum compute, link_s * belady's misses) (a schedule moves at least
that many experts during timed runs).

`prefetch`: integrated prefetching and caching over one link, Cao, Felten, Karlin and Li 1995, "aggressive": the
misses are fetched in reference order, each as early as the link and its victim allow (the victim's last use before
it must be done), evicting the resident with the farthest next use, which is never one the fetched run needs; a
fetched expert whose next use is farther than every resident's is streamed (fetched, used, not kept: the bypass
belady has); a run starts when the previous one ended and its experts have arrived. Its time is achievable, so it is
an upper bound on the optimum (Albers, Garg and Leonardi 2000 give the exact optimum as a linear program, not solved
here), and `floor` a lower bound. Untimed runs are barriers: the link drains, their demand loads free as belady's.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

NEVER = float("inf")
POOLS = ("even", "shared")


@dataclass
class LayerRun:
    layer: int
    timed: bool                  # a denoising iteration's run (counted and timed)
    experts: np.ndarray          # increasing expert ids it needs
    tokens: np.ndarray           # tokens routed to each of them
    rows: int                    # the layer's input rows


@dataclass
class Demand:
    """A trace's MoE layer runs in order, its iterations and the tokens they generated."""
    layers: list[int]
    runs: list[LayerRun]
    iterations: int
    tokens: int

    @property
    def max_tokens(self) -> int:
        """The most tokens any run routes to one expert (what a cost table's CPU terms must cover)."""
        return max((int(run.tokens.max()) for run in self.runs if len(run.tokens)), default=1)

    @classmethod
    def from_trace(cls, trace) -> "Demand":
        runs = []
        for i, layer in enumerate(trace.run_layer.tolist()):
            ids = trace.run_ids(i).reshape(-1).astype(np.int64)
            experts, tokens = np.unique(ids, return_counts=True)
            timed = int(trace.fwd_kind[trace.run_forward[i]]) == 1         # KINDS.index("iteration")
            runs.append(LayerRun(layer, timed, experts, tokens, len(trace.run_ids(i))))
        return cls(list(trace.layers), runs, int((trace.fwd_kind == 1).sum()), int(len(trace.req_output_ids)))

    @classmethod
    def from_records(cls, records, layers: list[int], top_k: int, tokens: int) -> "Demand":
        """From a live run's statistics (LayerRecord: forward, kind, layer, expert_tokens, pairs)."""
        runs = [LayerRun(r.layer, r.kind == "iteration", np.fromiter(r.expert_tokens, np.int64),
                         np.fromiter(r.expert_tokens.values(), np.int64), r.pairs // max(top_k, 1))
                for r in records]
        iterations = len({r.forward for r in records if r.kind == "iteration"})
        return cls(list(layers), runs, iterations, tokens)


@dataclass(frozen=True)
class CostTable:
    """Seconds of one MoE layer's compute per iteration (per layer, or one figure for all), of one expert over the
    link, and of the CPU path (the cost model's terms, oled/runtime/cost_model.py)."""
    compute_s: float | dict[int, float]
    link_s: float
    cpu_expert_s: np.ndarray | float = NEVER      # per tokens routed to the expert (index), or one figure
    cpu_call_s: float = 0.0
    cpu_slowdown_with_copies: float = 1.0
    copy_slowdown_with_cpu: float = 1.0
    transfer_s: float = 0.0
    row_s: float = 0.0
    pair_s: float = 0.0
    source: str = ""

    @classmethod
    def from_cost_model(cls, cost, compute_s, max_tokens: int, source: str) -> "CostTable":
        """From a measured CostModel (duck-typed: no torch here) and the layers' compute."""
        bandwidth = cost.h2d_gbps * 1e9
        return cls(compute_s=compute_s, link_s=cost.load_seconds(1),
                   cpu_expert_s=np.array([cost.cpu_expert_seconds(t) for t in range(max_tokens + 1)]),
                   cpu_call_s=cost.cpu_call_seconds, cpu_slowdown_with_copies=cost.cpu_slowdown_with_copies,
                   copy_slowdown_with_cpu=cost.copy_slowdown_with_cpu, transfer_s=cost.transfer_seconds,
                   row_s=cost.row_bytes / bandwidth, pair_s=cost.pair_bytes / bandwidth, source=source)

    def compute(self, layer: int) -> float:
        return self.compute_s[layer] if isinstance(self.compute_s, dict) else self.compute_s

    def cpu_seconds(self, tokens: np.ndarray) -> np.ndarray:
        if np.isscalar(self.cpu_expert_s):
            return np.full(len(tokens), float(self.cpu_expert_s))
        return np.asarray(self.cpu_expert_s)[tokens]

    @property
    def has_cpu(self) -> bool:
        return not (np.isscalar(self.cpu_expert_s) and self.cpu_expert_s == NEVER)


# ------------------------------------------------------------------------------------------------ belady
class _Pool:
    """A pool's residents with their next use's priority, farthest first on demand (a heap with stale entries)."""

    def __init__(self):
        self.prio: dict = {}
        self.heap: list = []

    def __len__(self) -> int:
        return len(self.prio)

    def __contains__(self, key) -> bool:
        return key in self.prio

    def set(self, key, prio: float) -> None:
        self.prio[key] = prio
        heapq.heappush(self.heap, (-prio, key))

    def remove(self, key) -> None:
        del self.prio[key]

    def farthest(self):
        """(priority, key) of the resident used farthest ahead (None when empty)."""
        heap = self.heap
        while heap and self.prio.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)
        return (-heap[0][0], heap[0][1]) if heap else None


@dataclass
class Schedule:
    """Belady's schedule: per run, its missed experts and which of them it keeps (positions into run.experts)."""
    pool: str
    slots: int                                          # per pool
    missed: list[np.ndarray] = field(default_factory=list)
    kept: list[np.ndarray] = field(default_factory=list)

    def misses(self, demand: Demand) -> int:
        return sum(len(m) for m, run in zip(self.missed, demand.runs) if run.timed)


def _pool_id(pool: str, layer: int) -> int:
    return 0 if pool == "shared" else layer


def _keys(demand: Demand) -> tuple[list, list, dict]:
    """Per run, the key (layer, expert) of each needed expert and its next use's priority after the run: the next
    run needing it if that run is timed, else NEVER (an untimed use reloads it free); and each key's first use's
    priority (what the free initial fill ranks by)."""
    keys = [[(run.layer, e) for e in run.experts.tolist()] for run in demand.runs]
    nxt: dict = {}
    after: list = [None] * len(demand.runs)
    for r in range(len(demand.runs) - 1, -1, -1):
        after[r] = [nxt.get(k, NEVER) for k in keys[r]]
        prio = r if demand.runs[r].timed else NEVER
        for k in keys[r]:
            nxt[k] = prio
    return keys, after, nxt


def _initial_pools(first: dict, pool: str, slots: int) -> dict:
    """The pools filled free before the first run, each with its `slots` soonest-used experts."""
    pools: dict = {}
    for k, prio in sorted(first.items(), key=lambda kv: (kv[1], kv[0])):
        p = pools.setdefault(_pool_id(pool, k[0]), _Pool())
        if prio != NEVER and len(p) < slots:
            p.set(k, prio)
    return pools


def belady(demand: Demand, slots: int, pool: str = "even") -> Schedule:
    """The fewest misses (Belady's MIN with bypass, module docstring); `slots` per pool (per layer when even, all
    layers' together when shared). The pools start filled free with the soonest-used experts."""
    if pool not in POOLS:
        raise ValueError(f"pool {pool!r}: one of {', '.join(POOLS)}")
    if slots < 0:
        raise ValueError(f"slots must be >= 0, got {slots}")
    keys, after, first = _keys(demand)
    pools = _initial_pools(first, pool, slots)
    sched = Schedule(pool, slots)
    for r, run in enumerate(demand.runs):
        cache = pools.setdefault(_pool_id(pool, run.layer), _Pool())
        missed, kept = [], []
        for j, (k, prio) in enumerate(zip(keys[r], after[r])):      # hits first: their priority moves on
            if k not in cache:
                missed.append(j)
            elif prio == NEVER:
                cache.remove(k)
            else:
                cache.set(k, prio)
        for j in missed:                                 # then the misses: kept if sooner than the farthest
            k, prio = keys[r][j], after[r][j]
            if prio == NEVER or slots == 0:
                continue
            if len(cache) >= slots:
                far, victim = cache.farthest()
                if far <= prio:
                    continue
                cache.remove(victim)
            cache.set(k, prio)
            kept.append(j)
        sched.missed.append(np.array(missed, dtype=np.int64))
        sched.kept.append(np.array(kept, dtype=np.int64))
    return sched


def lookahead_misses(demand: Demand, slots: int) -> int:
    """The misses of a retention that knows each layer's next timed run exactly and nothing further (budget split
    evenly): after every run of a layer its slots keep, from what was resident and what the run needed, first the
    experts its next timed run needs, then the most recently used (ties: lower id); what the run needs beyond them
    is bypassed. A reference, not a bound: what a policy whose predictions reach one iteration ahead makes with the
    least-recently-used order behind them (a cleverer order could make fewer)."""
    if slots < 0:
        raise ValueError(f"slots must be >= 0, got {slots}")
    layer_runs: dict[int, list[LayerRun]] = {}
    for run in demand.runs:
        layer_runs.setdefault(run.layer, []).append(run)
    misses = 0
    for runs in layer_runs.values():
        width = 1 + max((int(run.experts.max()) for run in runs if len(run.experts)), default=0)
        needed_next = [np.zeros(width, dtype=bool) for _ in runs]     # per run: its layer's next timed run's experts
        upcoming = np.zeros(width, dtype=bool)
        for r in range(len(runs) - 1, -1, -1):
            needed_next[r] = upcoming
            if runs[r].timed:
                upcoming = np.zeros(width, dtype=bool)
                upcoming[runs[r].experts] = True
        resident = np.zeros(width, dtype=bool)
        last = np.full(width, -1, dtype=np.int64)
        for r, run in enumerate(runs):
            if run.timed:
                misses += int((~resident[run.experts]).sum())
            last[run.experts] = r
            resident[run.experts] = True
            held = np.nonzero(resident)[0]
            if len(held) > slots:
                # np.lexsort: the last key is the most significant; reversed: needed next, then latest use, then lower id
                order = np.lexsort((-held, last[held], needed_next[r][held]))[::-1]
                ranked = held[order]
                keep = ranked[:slots]
                resident[:] = False
                resident[keep] = True
    return misses


# ------------------------------------------------------------------------------------------------ time
def layer_time(compute: float, link_misses: int, cpu_tokens: np.ndarray, rows: int, costs: CostTable) -> float:
    """T(L, C) of the module docstring: `link_misses` over the link, experts with `cpu_tokens` on the CPU."""
    on_cpu = len(cpu_tokens) > 0
    link = link_misses * costs.link_s * (costs.copy_slowdown_with_cpu if on_cpu else 1.0)
    cpu = 0.0
    if on_cpu:
        cpu = (costs.cpu_call_s + float(costs.cpu_seconds(cpu_tokens).sum())) \
            * (costs.cpu_slowdown_with_copies if link_misses else 1.0) \
            + costs.transfer_s + rows * costs.row_s + float(np.sum(cpu_tokens)) * costs.pair_s
    return max(compute, link, cpu)


def best_split(compute: float, forced: int, free_tokens: np.ndarray, rows: int, costs: CostTable) -> tuple[float, int]:
    """The least T with `forced` misses over the link and the misses with `free_tokens` split between link and CPU;
    returns (seconds, how many go to the CPU). The CPU takes the c cheapest for some c (its per-expert cost grows
    with tokens, the link's does not), so every c is tried."""
    if not costs.has_cpu or not len(free_tokens):
        return layer_time(compute, forced + len(free_tokens), free_tokens[:0], rows, costs), 0
    order = np.argsort(costs.cpu_seconds(free_tokens) + free_tokens * costs.pair_s, kind="stable")
    tok = free_tokens[order]
    times = [layer_time(compute, forced + len(tok) - c, tok[:c], rows, costs) for c in range(len(tok) + 1)]
    c = int(np.argmin(times))
    return times[c], c


def demand_seconds(demand: Demand, sched: Schedule, costs: CostTable, cpu: bool) -> float:
    """The timed runs' seconds with the schedule's misses served inside their layer: all over the link, or (cpu) the
    kept ones over the link and the others split at the best split."""
    total = 0.0
    for run, missed, kept in zip(demand.runs, sched.missed, sched.kept):
        if not run.timed:
            continue
        compute = costs.compute(run.layer)
        if not cpu:
            total += layer_time(compute, len(missed), run.tokens[:0], run.rows, costs)
            continue
        bypassed = np.setdiff1d(missed, kept)
        total += best_split(compute, len(kept), run.tokens[bypassed], run.rows, costs)[0]
    return total


def misses_seconds(demand: Demand, misses: list[int], costs: CostTable) -> float:
    """The timed runs' seconds with `misses[r]` misses of run r over the link (any policy's misses, replayed)."""
    return sum(layer_time(costs.compute(run.layer), m, run.tokens[:0], run.rows, costs)
               for run, m in zip(demand.runs, misses) if run.timed)


def floor_seconds(demand: Demand, sched: Schedule, costs: CostTable) -> float:
    """A lower bound on every link-only schedule: max(the timed runs' compute, the link time of belady's misses)."""
    compute = sum(costs.compute(run.layer) for run in demand.runs if run.timed)
    return max(compute, sched.misses(demand) * costs.link_s)


def prefetch_seconds(demand: Demand, slots: int, costs: CostTable, pool: str = "even") -> tuple[float, int]:
    """The aggressive prefetching schedule (module docstring): its timed seconds and the experts it fetches. A
    resident never used again stays until chosen as a victim (priority NEVER), so its slot is reused only once its
    last use is done."""
    keys, after, first = _keys(demand)
    pools = _initial_pools(first, pool, slots)
    ready: dict = {}                                     # key -> when its last fetch arrives
    last_use: dict = {}                                  # key -> when the last run using it ended
    clock = link = timed = segment = 0.0                 # clock: when the last run ended; segment: its timed start
    fetches = 0
    for r, run in enumerate(demand.runs):
        cache = pools.setdefault(_pool_id(pool, run.layer), _Pool())
        if not run.timed:                                # a barrier: its demand loads free, as belady's
            timed += clock - segment
            clock = segment = link = max(clock, link)
            for k, prio in zip(keys[r], after[r]):
                if k in cache or prio != NEVER:
                    cache.set(k, prio)
                last_use[k] = clock
            while len(cache) > slots:
                cache.remove(cache.farthest()[1])
            continue
        for k, prio in zip(keys[r], after[r]):
            if k in cache:
                continue
            start, keep = link, slots > 0 and prio != NEVER
            if keep and len(cache) >= slots:
                far, victim = cache.farthest()
                if far <= prio:                          # no resident is used later than it (or all are needed
                    keep = False                         # now): streamed, used, not kept
                else:
                    start = max(start, last_use.get(victim, 0.0))
                    cache.remove(victim)
            ready[k] = link = start + costs.link_s
            fetches += 1
            if keep:
                cache.set(k, r)
        begin = max([clock] + [ready.get(k, 0.0) for k in keys[r]])
        clock = begin + costs.compute(run.layer)
        for k, prio in zip(keys[r], after[r]):
            last_use[k] = clock
            if k in cache:
                cache.set(k, prio)
    return timed + clock - segment, fetches


# ------------------------------------------------------------------------------------------------ rows
@dataclass
class BoundRow:
    name: str                    # "bound:<kind>-<pool>", e.g. "bound:demand-link-even"
    misses_per_iteration: float  # belady's misses (prefetch: the experts its schedule fetches) per iteration
    ms_per_token: float | None   # None: no cost table
    definition: str


DEFINITIONS = {
    "belady": "the fewest expert-weighted misses an iteration any retention can make (Belady's MIN with bypass)",
    "demand-link": "belady's schedule, every miss over the link inside its layer beside the layer's compute "
                   "(achievable; not proven time-optimal)",
    "demand-coop": "belady's schedule, its kept misses over the link and the others split between link and CPU at the "
                   "split minimising the layer's time, beside the layer's compute (achievable; not proven "
                   "time-optimal)",
    "prefetch": "aggressive integrated prefetching and caching over one link (Cao, Felten, Karlin, Li 1995): "
                "achievable, an upper bound on the optimum; misses column: experts it fetches",
    "floor": "max(compute, link time of belady's misses): a lower bound on every link-only schedule",
    "lookahead": "a reference, not a bound: the misses of a retention that knows each layer's next iteration's "
                 "routing exactly and nothing further (least recently used behind it), budget split evenly",
}


def bound_rows(demand: Demand, slots_per_layer: int, costs: CostTable | None) -> list[BoundRow]:
    """Every bound at one budget, per pool (even, shared): belady's misses and, given a cost table, the times."""
    per_iteration = max(demand.iterations, 1)

    def row(kind: str, pool: str, misses: int, seconds: float | None) -> BoundRow:
        ms = None if seconds is None else seconds * 1e3 / max(demand.tokens, 1)
        return BoundRow(f"bound:{kind}-{pool}", misses / per_iteration, ms, DEFINITIONS[kind])

    rows = []
    for pool in POOLS:
        slots = slots_per_layer * (len(demand.layers) if pool == "shared" else 1)
        sched = belady(demand, slots, pool)
        misses = sched.misses(demand)
        rows.append(row("belady", pool, misses, None))
        if pool == "even":
            rows.append(row("lookahead", pool, lookahead_misses(demand, slots), None))
        if costs is None:
            continue
        rows.append(row("demand-link", pool, misses, demand_seconds(demand, sched, costs, cpu=False)))
        if costs.has_cpu:
            rows.append(row("demand-coop", pool, misses, demand_seconds(demand, sched, costs, cpu=True)))
        seconds, fetches = prefetch_seconds(demand, slots, costs, pool)
        rows.append(row("prefetch", pool, fetches, seconds))
        rows.append(row("floor", pool, misses, floor_seconds(demand, sched, costs)))
    return rows
