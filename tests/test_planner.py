"""The cost model and the cooperative miss planner (against brute force on small cases)."""
from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch

import oled
from oled.policies import ForwardInfo, LayerEvent, PolicyContext, make_policy
from oled.runtime.cost_model import CostModel, load_or_measure
from oled.runtime.planner import EXACT_MAX, PlanInputs, _loading_all_wins, plan_cost, split_misses


def _model(h2d=50.0, slowdown=1.2, gpu=5e-6, call=0.0, copy_slowdown=1.0, transfer=0.0, gpu_slope=0.0):
    # per-expert CPU times shaped like the H200 host's measurements (memory-bound, slowly rising with tokens)
    return CostModel(expert_bytes=6 * 2**20, h2d_gbps=h2d, cpu_seconds={1: 65e-6, 4: 75e-6, 8: 70e-6, 32: 90e-6},
                     cpu_call_seconds=call, cpu_slowdown_with_copies=slowdown,
                     gpu_seconds={1: gpu, 32: gpu + 31 * gpu_slope}, copy_slowdown_with_cpu=copy_slowdown,
                     transfer_seconds=transfer, row_bytes=4096, pair_bytes=8192, source="test")


def reference_cost(load, cpu, inputs: PlanInputs, m: CostModel) -> float:
    """The planner's objective written out plainly, term by term (independent of plan_costs' vectorised form)."""
    tok = inputs.tokens
    gpu_side = m.load_seconds(len(load)) * (m.copy_slowdown_with_cpu if cpu else 1.0)
    gpu_side += sum(m.gpu_expert_seconds(tok[e]) for e in load)
    cpu_side = 0.0
    if cpu:
        cpu_side = m.cpu_call_seconds + sum(m.cpu_expert_seconds(tok[e]) for e in cpu)
        if load:
            cpu_side *= m.cpu_slowdown_with_copies
        pairs = sum(tok[e] for e in cpu)
        cpu_side += m.transfer_seconds + (inputs.rows * m.row_bytes + pairs * m.pair_bytes) / (m.h2d_gbps * 1e9)
    evictions = max(0, len(load) - inputs.free_slots)
    return (max(gpu_side, cpu_side) - sum(inputs.credit.get(e, 0.0) for e in load)
            + sum(inputs.evict_loss[:evictions]))


def _brute(inputs: PlanInputs, m: CostModel) -> float:
    misses = list(inputs.tokens)
    best = None
    for r in range(inputs.min_loads, inputs.load_cap + 1):
        for load in itertools.combinations(misses, r):
            c = reference_cost(list(load), [e for e in misses if e not in load], inputs, m)
            best = c if best is None else min(best, c)
    return best


def _random_case(rng, n, credits=True):
    tokens = {e: rng.choice([1, 1, 2, 3, 4, 8, 16, 32]) for e in rng.sample(range(64), n)}
    cost = _model(h2d=rng.choice([10.0, 50.0, 200.0]), slowdown=rng.choice([1.0, 1.3]),
                  call=rng.choice([0.0, 20e-6, 400e-6]), copy_slowdown=rng.choice([1.0, 1.15]),
                  transfer=rng.choice([0.0, 15e-6]), gpu=rng.choice([0.0, 3e-6]), gpu_slope=rng.choice([0.0, 1e-7]))
    free = rng.randint(0, n)
    inputs = PlanInputs(tokens=tokens, rows=rng.choice([8, 32]), free_slots=free,
                        max_loads=rng.choice([None, free + rng.randint(0, 3)]),
                        credit={e: rng.choice([0.0, 0.0, 50e-6, 200e-6]) for e in tokens} if credits else {},
                        evict_loss=sorted(rng.choice([0.0, 20e-6, 90e-6]) for _ in range(n)) if credits else [])
    return inputs, cost


def test_interpolation_and_terms():
    m = _model(gpu=4e-6, gpu_slope=1e-7, transfer=10e-6)
    assert m.cpu_expert_seconds(1) == 65e-6 and m.cpu_expert_seconds(2) == pytest.approx(65e-6 + (75e-6 - 65e-6) / 3)
    assert m.cpu_expert_seconds(64) == pytest.approx(90e-6 * 2)
    assert m.gpu_expert_seconds(1) == 4e-6 and m.gpu_expert_seconds(32) == pytest.approx(4e-6 + 31e-7)
    assert CostModel(1, 1.0, {1: 1.0}).gpu_expert_seconds(8) == 0.0          # not measured: no GPU term
    assert m.load_seconds(10) == pytest.approx(10 * 6 * 2**20 / 50e9)
    assert m.cpu_transfer_seconds(32, 256) == pytest.approx(10e-6 + (32 * 4096 + 256 * 8192) / 50e9)
    called = _model(call=30e-6)
    assert called.cpu_jobs_seconds([]) == 0.0
    assert called.cpu_jobs_seconds([1, 4]) == pytest.approx(30e-6 + 65e-6 + 75e-6)


def test_a_costly_call_keeps_a_few_cheap_misses_off_the_cpu():
    tokens = {1: 1, 2: 1}
    cheap_call, costly_call = _model(h2d=25.0), _model(h2d=25.0, call=1e-3)
    assert split_misses(PlanInputs(tokens), cheap_call)[1], "without a call cost the CPU takes some of them"
    assert split_misses(PlanInputs(tokens), costly_call) == ([1, 2], [])


@pytest.mark.parametrize("seed", range(40))
def test_planner_matches_brute_force(seed):
    """Every term of the objective (credits, eviction losses, the per-call and transfer terms, the GPU term that
    grows with tokens, both slowdowns) and the load bounds, on cases the planner searches exhaustively."""
    rng = random.Random(seed)
    inputs, cost = _random_case(rng, rng.randint(0, EXACT_MAX))
    load, cpu = split_misses(inputs, cost)
    assert sorted(load + cpu) == sorted(inputs.tokens)
    assert inputs.min_loads <= len(load) <= inputs.load_cap
    if inputs.tokens:
        assert plan_cost(load, cpu, inputs, cost) == pytest.approx(reference_cost(load, cpu, inputs, cost), abs=1e-12)
        assert reference_cost(load, cpu, inputs, cost) == pytest.approx(_brute(inputs, cost), abs=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_planner_beyond_the_exhaustive_size(seed):
    """Beyond EXACT_MAX misses the planner searches three orders: exact without credits when the GPU time per expert
    does not depend on its tokens; with credits never worse than loading everything or nothing it may."""
    rng = random.Random(500 + seed)
    n = rng.randint(EXACT_MAX + 1, EXACT_MAX + 3)
    inputs, cost = _random_case(rng, n, credits=False)
    cost.gpu_seconds = {1: 3e-6, 32: 3e-6}
    load, cpu = split_misses(inputs, cost)
    assert reference_cost(load, cpu, inputs, cost) == pytest.approx(_brute(inputs, cost), abs=1e-12)
    inputs, cost = _random_case(rng, n, credits=True)
    load, cpu = split_misses(inputs, cost)
    ours = reference_cost(load, cpu, inputs, cost)
    misses = sorted(inputs.tokens)
    lo, hi = inputs.min_loads, inputs.load_cap
    assert ours <= reference_cost(misses[:hi], misses[hi:], inputs, cost) + 1e-12
    assert ours <= reference_cost(misses[:lo], misses[lo:], inputs, cost) + 1e-12


@pytest.mark.parametrize("seed", range(20))
def test_a_free_slot_is_never_left_empty_for_a_cpu_miss(seed):
    rng = random.Random(900 + seed)
    inputs, cost = _random_case(rng, rng.randint(1, 10))
    inputs.free_slots, inputs.max_loads = rng.randint(1, 12), None
    cost.h2d_gbps = 0.5                     # loads very costly: the makespan alone would send everything to the CPU
    load, cpu = split_misses(inputs, cost)
    assert len(load) == min(inputs.free_slots, len(inputs.tokens)) or not cpu
    assert len(load) >= min(inputs.free_slots, len(inputs.tokens))


def test_planner_extremes():
    tokens = {e: 4 for e in range(8)}
    slow_pcie = _model(h2d=0.1)     # copies take ages: everything on the CPU
    assert split_misses(PlanInputs(tokens), slow_pcie) == ([], sorted(tokens))
    slow_cpu = CostModel(6 * 2**20, 50.0, {1: 1.0, 32: 1.0})
    load, cpu = split_misses(PlanInputs(tokens), slow_cpu)
    assert cpu == [] and sorted(load) == sorted(tokens)
    # a large credit buys a load the makespan alone would not; a large eviction loss refuses it
    one = {7: 1}
    assert split_misses(PlanInputs(one), slow_pcie) == ([], [7])
    assert split_misses(PlanInputs(one, credit={7: 10.0}), slow_pcie) == ([7], [])
    assert split_misses(PlanInputs(one, credit={7: 10.0}, evict_loss=[20.0]), slow_pcie) == ([], [7])


def test_copy_time_outlasts_a_slow_start_and_takes_every_layer(monkeypatch):
    """The copy path's time is the least of at least five rounds after an untimed one, so copies slowed for their
    first four rounds (a transient like the one that cut five H200 measurements to 25-34 GB/s) do not set it; and its
    blobs come from every layer in turn, not from one layer's memory."""
    from types import SimpleNamespace

    from oled.runtime import cost_model

    ticks = iter(range(10**6))
    clock = {"now": 0.0}

    def fake_clock():                       # round r (two reads each) lasts 20 ms for r < 5, then 1 ms
        i = next(ticks)
        if i % 2 == 1:
            clock["now"] += 0.02 if i // 2 < 5 else 0.001
        return clock["now"]

    monkeypatch.setattr(cost_model.time, "perf_counter", fake_clock)
    asked = []

    def blob(layer, expert):
        asked.append((layer, expert))
        return torch.zeros(8)

    store = SimpleNamespace(layers=[3, 5, 7], numel=8, dtype=torch.float32, blob_dtype=torch.float32, blob=blob,
                            config=SimpleNamespace(num_experts=4))
    seconds = cost_model._time_copies(store, "cpu", 7, min_rounds=5, min_seconds=0.0)
    assert seconds == pytest.approx(0.001)  # round 6, the first fast one: the old three rounds would have read 0.02
    assert asked == [(3, 0), (5, 0), (7, 0), (3, 1), (5, 1), (7, 1), (3, 2)]


def test_copy_rate_keeps_the_faster_reading_and_says_when_they_differ(caplog):
    from oled.runtime.cost_model import _copy_rate_of_two

    with caplog.at_level("WARNING", logger="oled"):
        assert _copy_rate_of_two(50.0, 55.0) == 55.0 and not caplog.records      # within 20 %: nothing said
        assert _copy_rate_of_two(27.6, 54.1) == 54.1
    assert len(caplog.records) == 1 and "27.6 GB/s at the start" in caplog.records[0].getMessage()


def test_cost_model_measured_from_the_kernel_and_cached(tmp_path):
    torch.set_num_threads(1)
    llm = oled.LLM(random_weights="tiny", policy="tide", expert_budget="0.5", cpu_threads=1)
    eng = llm.engine
    kernel = eng.manager.cpu_kernel
    m = load_or_measure(eng.store, kernel, "cpu", cache_dir=tmp_path)
    assert m.h2d_gbps > 0 and set(m.cpu_seconds) == {1, 2, 4, 8, 16, 32}
    assert all(v > 0 for v in m.cpu_seconds.values()) and m.expert_bytes == eng.store.expert_bytes
    assert 0 <= m.cpu_call_seconds < 0.01
    assert set(m.gpu_seconds) == {1, 2, 4, 8, 16, 32} and all(v > 0 for v in m.gpu_seconds.values())
    assert m.transfer_seconds >= 0 and m.row_bytes == eng.store.hidden * 4 and m.pair_bytes == eng.store.hidden * 4
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
    return PolicyContext(layers=list(layers), num_experts=64, capacity=capacity, top_k=4, planner=split_misses,
                         expert_bytes=cost.expert_bytes, costs=cost)


def _event(demand, resident, layer=1):
    ids = np.array([[e] for e, n in demand.items() for _ in range(n)], dtype=np.int64).reshape(-1, 1)
    info = ForwardInfo(kind="iteration", start=0, tokens=len(ids), block_start=0, block_length=max(len(ids), 1))
    return LayerEvent(layer=layer, forward=info, ids=ids, weights=np.ones(ids.shape, np.float32), demand=demand,
                      resident=set(resident))


@pytest.mark.parametrize("name", ["lru", "lfu", "prefetch"])
def test_cooperative_policies_plan_with_the_planner(name):
    """misses=cooperative: the decision is the planner's optimal split, loads at least the free slots and at most
    the slots not holding a hit, no credit."""
    rng = random.Random(7)
    for call in (0.0, 60e-6):
        cost = _model(call=call)
        for trial in range(30):
            capacity = rng.randint(1, 8)
            policy = make_policy(name, misses="cooperative")
            assert policy.uses_cpu and policy.misses == "cooperative"
            policy.setup(_ctx(capacity, cost))
            demand = {e: rng.choice([1, 1, 2, 4, 9, 32]) for e in rng.sample(range(64), rng.randint(1, 8))}
            resident = set(rng.sample(sorted(demand), min(capacity, rng.randint(0, len(demand)))))
            resident |= set(range(60, 60 + rng.randint(0, capacity - len(resident))))   # residents not needed
            event = _event(demand, resident)
            d = policy.decide(event)
            misses = {e: n for e, n in demand.items() if e not in resident}
            hits = [e for e in demand if e in resident]
            inputs = PlanInputs(misses, rows=len(event.ids),
                                free_slots=capacity - len(resident), max_loads=capacity - len(hits))
            assert sorted(d.load + d.cpu) == sorted(misses)
            assert inputs.min_loads <= len(d.load) <= capacity - len(hits)
            assert reference_cost(d.load, d.cpu, inputs, cost) == pytest.approx(_brute(inputs, cost), rel=1e-9,
                                                                                 abs=1e-12), (name, trial)


def test_cooperative_split_follows_the_costs():
    demand = {e: 3 for e in range(10)}
    slow_pcie, slow_cpu = _model(h2d=0.5), _model(h2d=5000.0)
    full_cache = set(range(40, 56))                         # no free slot: the split is the costs' alone
    for cost, expect in ((slow_pcie, "cpu"), (slow_cpu, "load")):
        policy = make_policy("lru", misses="cooperative")
        policy.setup(_ctx(16, cost))
        d = policy.decide(_event(demand, full_cache))
        assert (d.cpu if expect == "cpu" else d.load) and not (d.load if expect == "cpu" else d.cpu)
    policy = make_policy("lru", misses="cooperative")
    policy.setup(_ctx(16, _model(h2d=6 * 2**20 / 70e-6 / 1e9, call=0.0)))    # a load takes what a CPU expert takes
    d = policy.decide(_event(demand, full_cache))
    assert 3 <= len(d.load) <= 7 and d.cpu                                   # both sides work
    policy = make_policy("lru", misses="cooperative")
    policy.setup(_ctx(16, slow_pcie))
    assert sorted(policy.decide(_event(demand, set())).load) == sorted(demand)   # free slots are filled


def test_cooperative_needs_costs_and_a_known_mode():
    with pytest.raises(ValueError, match="cost model"):
        make_policy("lfu", misses="cooperative").setup(PolicyContext(layers=[1], num_experts=8, capacity=2, top_k=2,
                                                                     expert_bytes=1))
    with pytest.raises(ValueError, match="misses must be one of load, cooperative"):
        make_policy("lru", misses="cpu")
    plain = make_policy("prefetch")
    assert plain.misses == "load" and not plain.uses_cpu
    plain.setup(PolicyContext(layers=[1], num_experts=8, capacity=2, top_k=2, expert_bytes=1))   # no costs needed
    assert plain.decide(_event({1: 2, 2: 1, 3: 1}, {2})).load == [1, 3]


def test_cost_model_from_bad_json():
    good = _model().to_dict()
    assert CostModel.from_dict(good) == _model()
    old = {k: v for k, v in good.items() if k not in ("gpu_seconds", "copy_slowdown_with_cpu", "transfer_seconds",
                                                      "row_bytes", "pair_bytes")}
    old["gpu_seconds_per_expert"] = 0.0                 # version 5, as traces recorded then carry it
    assert CostModel.from_dict(old).gpu_seconds == {} and CostModel.from_dict(old).cpu_seconds == _model().cpu_seconds
    for bad in ("not json", "[]", '{"cpu_seconds": {}}', json.dumps(dict(good, cpu_seconds={"x": 1})),
                json.dumps({k: v for k, v in good.items() if k != "h2d_gbps"})):
        with pytest.raises(ValueError, match="malformed cost model"):
            CostModel.from_json(bad)


def test_the_load_everything_bound_skips_only_searches_that_loading_everything_wins():
    """split_misses answers "load every miss" without a search when that beats a lower bound of every split with
    CPU work: whenever the bound fires, brute force over every such split finds none as cheap."""
    rng = random.Random(11)
    fired = 0
    for _ in range(600):
        inputs, cost = _random_case(rng, rng.randint(1, 7))
        misses = sorted(inputs.tokens)
        if inputs.load_cap != len(misses) or inputs.min_loads == len(misses):
            continue                      # the bound is only asked when every miss may load and some may not
        if not _loading_all_wins(misses, inputs, cost):
            continue
        fired += 1
        everything = reference_cost(misses, [], inputs, cost)
        for r in range(inputs.min_loads, len(misses)):
            for load in itertools.combinations(misses, r):
                assert everything < reference_cost(list(load), [e for e in misses if e not in load], inputs, cost)
        assert split_misses(inputs, cost) == (misses, [])
    assert fired >= 30
