"""The cost model and the cooperative miss planner (against brute force on small cases)."""
from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

import oled
from oled.policies import PolicyContext, make_policy
from oled.runtime.cost_model import CostModel, load_or_measure
from oled.runtime.planner import plan_cost, split_misses


def _model(h2d=50.0, slowdown=1.2, gpu=5e-6, call=0.0):
    # per-expert CPU times shaped like the H200 host's measurements (memory-bound, slowly rising with tokens)
    return CostModel(expert_bytes=6 * 2**20, h2d_gbps=h2d, cpu_seconds={1: 65e-6, 4: 75e-6, 8: 70e-6, 32: 90e-6},
                     cpu_call_seconds=call, cpu_slowdown_with_copies=slowdown, gpu_seconds_per_expert=gpu,
                     source="test")


def _brute(tokens, hits, cost, credit, max_loads=None):
    misses = list(tokens)
    best = None
    for r in range(len(misses) + 1):
        if max_loads is not None and r > max_loads:
            break
        for load in itertools.combinations(misses, r):
            cpu = [e for e in misses if e not in load]
            c = plan_cost(list(load), cpu, tokens, hits, cost, credit)
            best = c if best is None else min(best, c)
    return best


def test_interpolation():
    m = _model()
    assert m.cpu_expert_seconds(1) == 65e-6 and m.cpu_expert_seconds(2) == pytest.approx(65e-6 + (75e-6 - 65e-6) / 3)
    assert m.cpu_expert_seconds(64) == pytest.approx(90e-6 * 2)
    assert m.load_seconds(10) == pytest.approx(10 * 6 * 2**20 / 50e9)
    called = _model(call=30e-6)
    assert called.cpu_jobs_seconds([]) == 0.0
    assert called.cpu_jobs_seconds([1, 4]) == pytest.approx(30e-6 + 65e-6 + 75e-6)


def test_a_costly_call_keeps_a_few_cheap_misses_off_the_cpu():
    tokens = {1: 1, 2: 1}
    cheap_call, costly_call = _model(h2d=25.0), _model(h2d=25.0, call=1e-3)
    assert split_misses(tokens, 0, cheap_call)[1], "without a call cost the CPU takes some of them"
    assert split_misses(tokens, 0, costly_call) == ([1, 2], [])


@pytest.mark.parametrize("seed", range(30))
def test_planner_matches_brute_force_without_credit(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 9)
    tokens = {e: rng.choice([1, 1, 2, 3, 4, 8, 16, 32]) for e in rng.sample(range(64), n)}
    cost = _model(h2d=rng.choice([10.0, 50.0, 200.0]), slowdown=rng.choice([1.0, 1.3]),
                  call=rng.choice([0.0, 20e-6, 400e-6]))
    hits = rng.randint(0, 20)
    cap = rng.choice([None, 2])
    load, cpu = split_misses(tokens, hits, cost, max_loads=cap)
    assert sorted(load + cpu) == sorted(tokens)
    assert plan_cost(load, cpu, tokens, hits, cost) == pytest.approx(_brute(tokens, hits, cost, None, cap), abs=1e-12)


@pytest.mark.parametrize("seed", range(30))
def test_planner_with_credit_close_to_brute_force(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(1, 9)
    tokens = {e: rng.choice([1, 2, 4, 8, 32]) for e in rng.sample(range(64), n)}
    credit = {e: rng.choice([0.0, 0.0, 50e-6, 200e-6]) for e in tokens}
    cost = _model()
    load, cpu = split_misses(tokens, 4, cost, credit)
    ours, best = plan_cost(load, cpu, tokens, 4, cost, credit), _brute(tokens, 4, cost, credit)
    # never worse than loading everything or computing everything on the CPU, and near the optimum
    assert ours <= plan_cost(list(tokens), [], tokens, 4, cost, credit) + 1e-12
    assert ours <= plan_cost([], list(tokens), tokens, 4, cost, credit) + 1e-12
    assert ours - best <= 0.05 * abs(best) + 30e-6


def test_planner_extremes():
    tokens = {e: 4 for e in range(8)}
    slow_pcie = _model(h2d=0.1)     # copies take ages: everything on the CPU
    assert split_misses(tokens, 0, slow_pcie) == ([], sorted(tokens))
    slow_cpu = CostModel(6 * 2**20, 50.0, {1: 1.0, 32: 1.0})
    load, cpu = split_misses(tokens, 0, slow_cpu)
    assert cpu == [] and sorted(load) == sorted(tokens)


def test_cost_model_measured_from_the_kernel_and_cached(tmp_path):
    torch.set_num_threads(1)
    llm = oled.LLM(random_weights="tiny", policy="tide", expert_budget="0.5", cpu_threads=1)
    eng = llm.engine
    kernel = eng.manager.cpu_kernel
    m = load_or_measure(eng.store, kernel, "cpu", cache_dir=tmp_path)
    assert m.h2d_gbps > 0 and set(m.cpu_seconds) == {1, 2, 4, 8, 16, 32}
    assert all(v > 0 for v in m.cpu_seconds.values()) and m.expert_bytes == eng.store.expert_bytes
    assert 0 <= m.cpu_call_seconds < 0.01
    cached = list(tmp_path.glob("*.json"))
    assert len(cached) == 1
    assert load_or_measure(eng.store, kernel, "cpu", cache_dir=tmp_path) == m   # read back, not re-measured
    cached[0].write_text("{damaged")
    again = load_or_measure(eng.store, kernel, "cpu", cache_dir=tmp_path)      # measured again, and rewritten
    assert again.cpu_seconds.keys() == m.cpu_seconds.keys() and CostModel.from_json(cached[0].read_text()) == again


def test_cpu_policies_run_with_the_measured_cost_model_and_report_its_error():
    """A policy that computes on the CPU gets the engine's measured cost model; every CPU job's predicted time is
    recorded beside its measured time, so a run shows how well the model the planner relies on holds."""
    llm = oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="tide", expert_budget="0.25",
                   cpu_threads=1)
    eng = llm.engine
    assert eng.manager.costs is eng.costs and eng.costs.source.startswith("measured")
    llm.generate("hello world", gen_length=32)
    s = llm.stats()
    assert s["cpu_pairs_per_iteration"] > 0 and s["cpu_ms_per_iteration"] > 0
    assert s["cpu_cost_model_ratio"] > 0
    rows = [r for r in eng.manager.stats.records if r.pairs_cpu]
    assert rows and all(r.cpu_s > 0 and r.cpu_s_model > 0 for r in rows)
    assert all(r.cpu_s == 0 and r.cpu_s_model == 0 for r in eng.manager.stats.records if not r.pairs_cpu)
    eng.set_runtime("lru", "0.25")                      # no CPU: no cost model in the manager, nothing to report
    assert eng.manager.costs is None
    llm.generate("hello world", gen_length=32)
    assert llm.stats()["cpu_cost_model_ratio"] is None and llm.stats()["cpu_ms_per_iteration"] == 0


# ------------------------------------------------------------------------------ cooperative miss handling in policies
def _ctx(capacity, cost, layers=(1,)):
    return PolicyContext(layers=list(layers), num_experts=64, capacity=capacity, top_k=4,
                         expert_bytes=cost.expert_bytes, costs=cost)


@pytest.mark.parametrize("name", ["lru", "lfu", "prefetch"])
def test_cooperative_policies_plan_with_the_planner(name):
    """misses=cooperative: the plan is the planner's optimal split, loads capped at the slots not holding a hit."""
    rng = random.Random(7)
    for call in (0.0, 60e-6):
        cost = _model(call=call)
        for trial in range(30):
            capacity = rng.randint(1, 8)
            policy = make_policy(name, misses="cooperative")
            assert policy.uses_cpu and policy.misses == "cooperative"
            policy.setup(_ctx(capacity, cost))
            demand = {e: rng.choice([1, 1, 2, 4, 9, 32]) for e in rng.sample(range(64), rng.randint(1, 9))}
            resident = set(rng.sample(sorted(demand), min(capacity, rng.randint(0, len(demand)))))
            plan = policy.plan(1, demand, resident)
            misses = {e: n for e, n in demand.items() if e not in resident}
            hits, room = len(demand) - len(misses), capacity - len(demand) + len(misses)
            assert sorted(plan.load + plan.cpu) == sorted(misses)
            assert len(plan.load) <= room
            assert plan_cost(plan.load, plan.cpu, misses, hits, cost) == pytest.approx(
                _brute(misses, hits, cost, None, max_loads=room), rel=1e-9, abs=1e-12), (name, trial)


def test_cooperative_split_follows_the_costs():
    demand = {e: 3 for e in range(10)}
    slow_pcie, slow_cpu = _model(h2d=0.5), _model(h2d=5000.0)
    for cost, expect in ((slow_pcie, "cpu"), (slow_cpu, "load")):
        policy = make_policy("lru", misses="cooperative")
        policy.setup(_ctx(16, cost))
        plan = policy.plan(1, demand, set())
        assert (plan.cpu if expect == "cpu" else plan.load) and not (plan.load if expect == "cpu" else plan.cpu)
    policy = make_policy("lru", misses="cooperative")
    policy.setup(_ctx(16, _model(h2d=6 * 2**20 / 70e-6 / 1e9, call=0.0)))    # a load takes what a CPU expert takes
    plan = policy.plan(1, demand, set())
    assert 3 <= len(plan.load) <= 7 and plan.cpu                             # both sides work


def test_cooperative_needs_costs_and_a_known_mode():
    with pytest.raises(ValueError, match="cost model"):
        make_policy("lfu", misses="cooperative").setup(PolicyContext(layers=[1], num_experts=8, capacity=2, top_k=2,
                                                                     expert_bytes=1))
    with pytest.raises(ValueError, match="misses must be one of load, cooperative"):
        make_policy("lru", misses="cpu")
    plain = make_policy("prefetch")
    assert plain.misses == "load" and not plain.uses_cpu
    plain.setup(PolicyContext(layers=[1], num_experts=8, capacity=2, top_k=2, expert_bytes=1))   # no costs needed
    assert plain.plan(1, {1: 2, 2: 1, 3: 1}, {2}).load == [1, 3]


def test_cost_model_from_bad_json():
    good = _model().to_dict()
    assert CostModel.from_dict(good) == _model()
    for bad in ("not json", "[]", '{"cpu_seconds": {}}', json.dumps(dict(good, cpu_seconds={"x": 1})),
                json.dumps({k: v for k, v in good.items() if k != "h2d_gbps"})):
        with pytest.raises(ValueError, match="malformed cost model"):
            CostModel.from_json(bad)
