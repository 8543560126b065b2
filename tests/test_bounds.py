"""oled/bounds.py: each exact bound against a brute-force search over every schedule on tiny cases, the prefetch
bound between its lower bound and the exact optimum's search, and no policy replay beating a bound."""
from __future__ import annotations

import functools
import itertools
from pathlib import Path

import numpy as np
import pytest

from oled.bounds import (CostTable, Demand, LayerRun, _initial_pools, _keys, belady, best_split, bound_rows,
                         lookahead_misses,
                         demand_seconds, floor_seconds, layer_time, misses_seconds, prefetch_seconds)
from oled.policies import POLICIES
from oled.trace import Trace, replay
from tests.costs import balanced_costs

TRACE = Path(__file__).parent / "data" / "tiny-code.trace"


def random_demand(seed: int, layers=(0, 1), experts: int = 4, runs: int = 6, untimed: float = 0.2) -> Demand:
    """Runs cycling through `layers`, each needing 1-3 random experts with 1-4 tokens; some untimed."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(runs):
        ids = np.sort(rng.choice(experts, size=int(rng.integers(1, 4)), replace=False))
        out.append(LayerRun(layers[r % len(layers)], bool(rng.random() >= untimed or r == runs - 1), ids,
                            rng.integers(1, 5, size=len(ids)), 4))
    return Demand(list(layers), out, sum(run.timed for run in out), 10)


def _subsets(items, most: int):
    items = sorted(items)
    return [frozenset(c) for n in range(min(most, len(items)) + 1) for c in itertools.combinations(items, n)]


def _pools(demand: Demand, pool: str) -> dict:
    return {layer: (0 if pool == "shared" else layer) for layer in demand.layers}


def brute_demand(demand: Demand, slots: int, pool: str, cost) -> float:
    """The least sum of cost(run, missed experts) over timed runs, over every schedule: any free initial fill, after
    each run any `slots` of (resident + needed) per pool."""
    of = _pools(demand, pool)
    keys = sorted({(run.layer, e) for run in demand.runs for e in run.experts.tolist()})

    def fits(state):
        return all(sum(of[k[0]] == p for k in state) <= slots for p in set(of.values()))

    @functools.cache
    def best(r: int, state: frozenset) -> float:
        if r == len(demand.runs):
            return 0.0
        run = demand.runs[r]
        need = {(run.layer, e) for e in run.experts.tolist()}
        missed = [e for e in run.experts.tolist() if (run.layer, e) not in state]
        here = cost(run, missed) if run.timed else 0.0
        nexts = [s for s in _subsets(state | need, len(state | need)) if fits(s)]
        return here + min(best(r + 1, s) for s in nexts)

    return min(best(0, s) for s in _subsets(keys, len(keys)) if fits(s))


@pytest.mark.parametrize("pool", ["even", "shared"])
@pytest.mark.parametrize("seed", range(12))
def test_belady_is_the_fewest_misses_of_every_schedule(seed, pool):
    demand = random_demand(seed)
    for slots in (1, 2):
        want = brute_demand(demand, slots, pool, lambda run, missed: len(missed))
        assert belady(demand, slots, pool).misses(demand) == want


def lookahead_by_hand(demand: Demand, slots: int) -> int:
    """The one-iteration lookahead's rule written out with sets, run by run."""
    resident = {layer: set() for layer in demand.layers}
    last: dict = {}
    misses = 0
    for r, run in enumerate(demand.runs):
        needed = set(run.experts.tolist())
        if run.timed:
            misses += len(needed - resident[run.layer])
        for e in needed:
            last[run.layer, e] = r
        nxt = next((later for later in demand.runs[r + 1:] if later.layer == run.layer and later.timed), None)
        coming = set() if nxt is None else set(nxt.experts.tolist())
        held = resident[run.layer] | needed
        ranked = sorted(held, key=lambda e: (e not in coming, -last[run.layer, e], e))
        resident[run.layer] = set(ranked[:slots])
    return misses


@pytest.mark.parametrize("seed", range(12))
def test_the_lookahead_keeps_the_next_iterations_experts_first(seed):
    demand = random_demand(seed, experts=6, runs=14)
    for slots in (1, 2, 3):
        got = lookahead_misses(demand, slots)
        assert got == lookahead_by_hand(demand, slots)
        assert got >= belady(demand, slots).misses(demand)      # a reference that never beats the fewest


def test_the_shared_pool_never_misses_more_than_the_even_split():
    for seed in range(20):
        demand = random_demand(seed, layers=(0, 1, 2), runs=9)
        for slots in (1, 2):
            assert belady(demand, slots * 3, "shared").misses(demand) <= belady(demand, slots, "even").misses(demand)


COSTS = CostTable(compute_s=1.0, link_s=0.7, cpu_expert_s=np.array([0.0, 0.5, 0.6, 0.8, 1.1]), cpu_call_s=0.1,
                  cpu_slowdown_with_copies=1.2, copy_slowdown_with_cpu=1.1, transfer_s=0.05, row_s=0.01, pair_s=0.02)


def test_the_best_split_is_the_least_layer_time_of_every_split():
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = rng.integers(1, 5, size=int(rng.integers(0, 6)))
        forced, compute = int(rng.integers(0, 3)), float(rng.choice([0.0, 1.0, 2.5]))
        seconds, on_cpu = best_split(compute, forced, tokens, 4, COSTS)
        every = [layer_time(compute, forced + len(tokens) - len(c), tokens[list(c)], 4, COSTS)
                 for n in range(len(tokens) + 1) for c in itertools.combinations(range(len(tokens)), n)]
        assert seconds == pytest.approx(min(every))
        assert seconds == pytest.approx(layer_time(compute, forced + len(tokens) - on_cpu,
                                                   np.sort(tokens)[:on_cpu], 4, COSTS))


def test_the_layer_time_is_the_planners_objective_beside_the_compute():
    """Without the loads' GPU compute (inside the layer's compute), credits and eviction losses, the planner's
    objective of a split is the layer time's miss service."""
    from oled.runtime.cost_model import CostModel
    from oled.runtime.planner import PlanInputs, plan_cost

    cost = CostModel(expert_bytes=10**6, h2d_gbps=2.0, cpu_seconds={1: 3e-4, 4: 9e-4}, cpu_call_seconds=5e-5,
                     cpu_slowdown_with_copies=1.3, copy_slowdown_with_cpu=1.2, transfer_seconds=2e-5,
                     row_bytes=1000, pair_bytes=4000)
    table = CostTable.from_cost_model(cost, 0.0, 8, "test")
    tokens = {3: 1, 5: 4, 9: 2, 11: 3}
    inputs = PlanInputs(tokens=tokens, rows=6)
    for n in range(len(tokens) + 1):
        for cpu in itertools.combinations(sorted(tokens), n):
            load = [e for e in tokens if e not in cpu]
            want = plan_cost(load, list(cpu), inputs, cost)
            got = layer_time(0.0, len(load), np.array([tokens[e] for e in cpu], dtype=np.int64), 6, table)
            assert got == pytest.approx(want)


@pytest.mark.parametrize("seed", range(8))
def test_demand_times_lie_between_the_floor_and_above_the_time_optimum(seed):
    """demand-link is the time of belady's schedule: at least the least time of every schedule (brute force), which is
    at least the floor; demand-coop never exceeds demand-link."""
    demand = random_demand(seed)
    table = CostTable(compute_s={0: 1.0, 1: 0.6}, link_s=0.7, cpu_expert_s=COSTS.cpu_expert_s)
    for pool, slots in (("even", 1), ("even", 2), ("shared", 2)):
        sched = belady(demand, slots, pool)
        link = demand_seconds(demand, sched, table, cpu=False)
        optimum = brute_demand(demand, slots, pool,
                               lambda run, missed: layer_time(table.compute(run.layer), len(missed),
                                                              run.tokens[:0], run.rows, table))
        assert floor_seconds(demand, sched, table) <= optimum + 1e-12 <= link + 2e-12
        assert demand_seconds(demand, sched, table, cpu=True) <= link + 1e-12


def brute_prefetch(demand: Demand, slots: int, pool: str, costs: CostTable, start: frozenset) -> float:
    """The least timed seconds of integrated prefetching and caching over one link, over every schedule of the model
    in oled/bounds.py: before each timed run, its missing experts are fetched (in any order, each into the slot of any
    resident it does not need, or streamed), each starting when the link is free and its victim's last use ended; a
    run starts when the last ended and its experts arrived; untimed runs: any free reload, the link drained. From the
    initial pools `start`; branches no faster than the best found are cut."""
    of = _pools(demand, pool)
    best = [np.inf]

    def fits(state):
        return all(sum(of[k[0]] == p for k in state) <= slots for p in set(of.values()))

    def go(r, cache: frozenset, clock, link, segment, timed, last_end: dict, ready: dict):
        if timed + clock - segment >= best[0]:
            return
        if r == len(demand.runs):
            best[0] = min(best[0], timed + clock - segment)
            return
        run = demand.runs[r]
        need = [(run.layer, e) for e in run.experts.tolist()]
        if not run.timed:
            now = max(clock, link)
            ends = {**last_end, **{k: now for k in need}}
            for s in _subsets(cache | set(need), len(cache | set(need))):
                if fits(s):
                    go(r + 1, s, now, now, now, timed + clock - segment, ends, ready)
            return
        missing = [k for k in need if k not in cache]
        for order in itertools.permutations(missing):
            fetch(r, list(order), cache, clock, link, segment, timed, last_end, ready)

    def fetch(r, todo, cache, clock, link, segment, timed, last_end, ready):
        run = demand.runs[r]
        need = {(run.layer, e) for e in run.experts.tolist()}
        if not todo:
            begin = max([clock] + [ready.get(k, 0.0) for k in need])
            end = begin + costs.compute(run.layer)
            go(r + 1, cache, end, link, segment, timed, {**last_end, **{k: end for k in need}}, ready)
            return
        k, rest = todo[0], todo[1:]
        in_pool = [v for v in cache if of[v[0]] == of[k[0]]]
        arrive = link + costs.link_s
        fetch(r, rest, cache, clock, arrive, segment, timed, last_end, {**ready, k: arrive})   # streamed
        if len(in_pool) < slots:
            fetch(r, rest, cache | {k}, clock, arrive, segment, timed, last_end, {**ready, k: arrive})
            return
        for v in in_pool:
            if v in need:
                continue
            arrive = max(link, last_end.get(v, 0.0)) + costs.link_s
            fetch(r, rest, (cache - {v}) | {k}, clock, arrive, segment, timed, last_end, {**ready, k: arrive})

    go(0, start, 0.0, 0.0, 0.0, 0.0, {}, {})
    return best[0]


@pytest.mark.parametrize("seed", range(8))
def test_prefetch_is_achievable_and_above_the_floor(seed):
    """The aggressive schedule's time is at least the exact optimum of the model (search over every schedule from the
    same initial pools), which is at least the floor."""
    demand = random_demand(seed, experts=3, runs=5, untimed=0.1)
    table = CostTable(compute_s={0: 1.0, 1: 0.5}, link_s=0.8)
    for pool, slots in (("even", 1), ("even", 2), ("shared", 2)):
        aggressive, _ = prefetch_seconds(demand, slots, table, pool)
        start = frozenset(k for p in _initial_pools(_keys(demand)[2], pool, slots).values() for k in p.prio)
        optimum = brute_prefetch(demand, slots, pool, table, start)
        assert floor_seconds(demand, belady(demand, slots, pool), table) <= optimum + 1e-12 <= aggressive + 2e-12


def test_prefetch_hides_the_link_under_compute_where_a_demand_schedule_cannot():
    """Three slots, four experts used once each: the fourth is fetched into the first's slot as soon as the first
    run ends, under the next runs' compute; served inside its own run, it costs that run the link's time."""
    runs = [LayerRun(0, True, np.array([e]), np.array([1]), 1) for e in (0, 1, 2, 3)]
    demand = Demand([0], runs, 4, 4)
    table = CostTable(compute_s=1.0, link_s=1.5)
    assert prefetch_seconds(demand, 3, table) == (4.0, 1)
    assert demand_seconds(demand, belady(demand, 3), table, cpu=False) == 4.5


@pytest.fixture(scope="module")
def small_trace():
    return Trace.load(TRACE).first_requests(1)


@pytest.mark.parametrize("budget", ["0.6", "0.25"])
def test_no_policy_replay_beats_the_bounds(small_trace, budget):
    """Every policy replayed on a trace of the bundled model: its misses at least belady's (even split; the shared pool
    fewer still), its time with its misses served over the link at least the floor and belady's demand time."""
    demand = Demand.from_trace(small_trace)
    model = small_trace.header["model"]
    costs = balanced_costs(model["expert_bytes"])
    table = CostTable.from_cost_model(costs, 1e-4, 64, "test")
    slots = round(float(budget) * model["num_experts"])
    rows = {r.name: r for r in bound_rows(demand, slots, table)}
    assert rows["bound:belady-shared"].misses_per_iteration <= rows["bound:belady-even"].misses_per_iteration
    for name in POLICIES:
        if name == "full":
            continue
        options = {"popularity": small_trace.popularity()} if name == "fiddler" else {}
        stats = replay(small_trace, name, f"{slots / model['num_experts']}", costs, **options).stats
        assert len(stats.records) == len(demand.runs)
        misses = [rec.experts - rec.experts_hit for rec in stats.records]
        per_iteration = stats.summary()["misses_per_iteration"]
        assert per_iteration >= rows["bound:belady-even"].misses_per_iteration - 1e-12, name
        ms = misses_seconds(demand, misses, table) * 1e3 / demand.tokens
        assert ms >= rows["bound:floor-even"].ms_per_token - 1e-12, name
        assert ms >= rows["bound:demand-link-even"].ms_per_token - 1e-12, name


def test_belady_with_bypass_keeps_lfu_below_it_where_loading_every_miss_did_not():
    """A layer needing more experts than its slots: loading every miss (the old belady) evicts what the next run
    needs; belady with bypass keeps it, and lfu, which loads every miss, is below."""
    from oled.policies.base import LayerDecision
    from oled.policies.belady import BeladyPolicy

    class LoadEveryMiss(BeladyPolicy):             # the old belady: every miss loaded, the farthest used evicted
        def decide(self, event):
            now = self.position[event.layer]
            decision = super().decide(event)
            evict = sorted(event.resident | set(event.misses), key=lambda e: (-self.next_use(event.layer, e, now), e))
            return LayerDecision(load=decision.load + decision.cpu, evict=evict)

    trace = Trace.load(TRACE)
    for budget in ("0.25", "0.4"):
        rate = {name: replay(trace, policy, budget).stats.summary()["hit_rate_experts"]
                for name, policy in (("belady", "belady"), ("lfu", "lfu"), ("all", LoadEveryMiss()))}
        assert rate["lfu"] <= rate["belady"] and rate["all"] < rate["belady"]


def test_used_before_evicted_counts_the_loads_a_later_layer_hit():
    """lru, two slots, one expert a forward: 0, 1, 0 (a hit on the load of 0), 2 (evicts 1, never used), 0, 3 (evicts
    2, never used): four loads, one used before its slot was given up; 3 still resident counts as not used."""
    import torch

    from oled.policies import make_policy
    from oled.policies.base import ForwardInfo
    from oled.runtime.budget import parse_budget
    from oled.runtime.expert_cache import ExpertCache
    from oled.runtime.residency import Residency
    from oled.runtime.stats import RunStats
    from oled.trace.replay import decide_layer

    budget = parse_budget("0.5", num_layers=1, num_experts=4, expert_bytes=8)
    cache = ExpertCache([0], budget, 1, torch.float32, "meta", 4)
    stats = RunStats()
    res = Residency(cache, make_policy("lru"), stats, num_experts=4, top_k=1, expert_bytes=8)
    for e in (0, 1, 0, 2, 0, 3):
        res.begin_forward(ForwardInfo("iteration", 0, 1, 0, 1))
        decide_layer(res, 0, np.array([[e]]), np.ones((1, 1), np.float32))
    summary = stats.summary()
    assert summary["totals"]["loads"] == 4 and summary["totals"]["loads_used"] == 1
    assert summary["used_before_evicted"] == 0.25 and summary["misses_per_iteration"] == 4 / 6
