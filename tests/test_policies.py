"""Policies: eviction orders (lru, lfu), prefetch predictions, tide refreshes, fiddler placement and `oled calibrate`.

Policies are driven directly (PolicyContext + layer events in, decisions out) and through the ExpertManager of a tiny
random-weights model with scripted routing (manager.run with chosen expert ids), checking the cache's bookkeeping
and that the layer output stays the mixture of the routed experts wherever they ran.
"""
from __future__ import annotations

import datetime
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import oled
from oled.cli import main as cli_main
from oled.models.router import sigmoid_group_route, softmax_route
from oled.policies import (POLICIES, ForwardInfo, IterationEvent, LayerEvent, PolicyContext, make_policy,
                           policy_class)
from oled.policies.fiddler import FiddlerPolicy, load_popularity, popularity_document
from oled.policies.lfu import LFUPolicy
from oled.policies.lru import LRUPolicy
from oled.policies.prefetch import PrefetchPolicy
from oled.policies.tide import TidePolicy

TINY_LAYERS = [1, 2]            # MoE layers of the `tiny` preset (layer 0 is dense)


def ctx(capacity=3, layers=(1, 2), num_experts=16, top_k=4) -> PolicyContext:
    return PolicyContext(layers=list(layers), num_experts=num_experts, capacity=capacity, top_k=top_k,
                         expert_bytes=1)


def event(step, iteration, block_done=False, block=0) -> IterationEvent:
    n = 4
    return IterationEvent(block=block, step=step, iteration=iteration, state=np.ones(n, np.int8),
                          confidence=np.zeros(n), block_done=block_done)


def layer_event(layer, demand, resident, predicted=None, next_resident=None) -> LayerEvent:
    """A layer's event with `demand` (expert -> rows, one expert per row) and the given resident set."""
    ids = np.array([[e] for e, n in demand.items() for _ in range(n)], dtype=np.int64).reshape(-1, 1)
    info = ForwardInfo(kind="iteration", start=0, tokens=len(ids), block_start=0, block_length=max(len(ids), 1))
    ev = LayerEvent(layer=layer, forward=info, ids=ids, weights=np.ones(ids.shape, np.float32), demand=dict(demand),
                    resident=set(resident))
    if predicted is not None:
        ev.predicted, ev.next_layer, ev.next_resident = predicted, layer + 1, set(next_resident)
    return ev


def use(p, layer, demand):
    """The layer ran with every expert of `demand` resident."""
    return p.decide(layer_event(layer, demand, set(demand)))


def first(candidates, order):
    """The expert an eviction order evicts first among the candidates (None: it evicts none of them)."""
    return next((e for e in order if e in set(candidates)), None)


def victim(p, layer, candidates):
    p.touch(layer)
    return first(candidates, p.eviction_order(layer, set(candidates)))


# ----------------------------------------------------------------------------------------- scripted manager runs
def routing(rows) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] from rows of expert ids, and positive routing weights."""
    ids = torch.tensor(rows, dtype=torch.int64)
    g = torch.Generator().manual_seed(int(ids.sum()))
    w = torch.rand(ids.shape, generator=g) + 0.1
    return ids, w


def expert_ref(store, layer, e, x):
    gate, up, down = (store.part(layer, e, p).float() for p in ("gate_proj", "up_proj", "down_proj"))
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


def moe_ref(store, layer, x, ids, w):
    out = torch.zeros(x.shape[0], store.hidden)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += w[t, j] * expert_ref(store, layer, int(ids[t, j]), x[t:t + 1])[0]
    return out


def scripted_run(manager, layer, rows, seed=0):
    """Run one MoE layer with the given routing; check the output against a direct computation."""
    ids, w = routing(rows)
    x = torch.randn(ids.shape[0], manager.hidden, generator=torch.Generator().manual_seed(seed))
    manager.begin_forward(ForwardInfo(kind="iteration", start=0, tokens=ids.shape[0], block_start=0,
                                      block_length=ids.shape[0]))
    y = manager.run(layer, x, ids, w)
    torch.testing.assert_close(y.float(), moe_ref(manager.store, layer, x, ids, w), rtol=1e-4, atol=1e-5)
    return manager.stats.records[-1]


def resident(manager, layer) -> set[int]:
    return set(manager.cache.resident(layer))


def tiny(policy, budget, **kw):
    return oled.LLM(random_weights="tiny", device="cpu", dtype="float32", expert_budget=budget, policy=policy, **kw)


# ---------------------------------------------------------------------------------------------------- registry
def test_registry_names_and_options():
    assert {"full", "lru", "lfu", "prefetch", "fiddler", "tide", "oled", "oled-retain", "oled-coop",
            "belady"} <= set(POLICIES)
    for name in POLICIES:
        assert make_policy(name, popularity={1: {0: 1}}).name == name
    assert make_policy("tide").tau == 4                                   # default
    assert make_policy("tide", tau=None, popularity=None).tau == 4        # unset options are not passed
    assert make_policy("tide", tau=2, popularity="ignored.json").tau == 2
    assert isinstance(make_policy("lru", tau=3, popularity="x"), LRUPolicy)   # options a policy lacks are dropped
    assert make_policy("prefetch").wants_prediction and isinstance(make_policy("prefetch"), LRUPolicy)
    assert make_policy("fiddler", popularity={1: {0: 1}}).uses_cpu
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("mru")
    for bad in (0, -1, 1.5, "x"):
        with pytest.raises(ValueError):
            make_policy("tide", tau=bad)


def test_gpu_only_and_cpu_policies_declare_it():
    assert not any(policy_class(p).uses_cpu for p in ("full", "lru", "lfu", "prefetch", "belady"))
    assert not make_policy("oled-retain").uses_cpu
    assert all(make_policy(p, popularity={1: {0: 1}}).uses_cpu for p in ("fiddler", "tide", "oled", "oled-coop"))


# ------------------------------------------------------------------------------------------------- lru / lfu
def test_lru_eviction_order_direct():
    p = LRUPolicy()
    p.setup(ctx(capacity=3))
    for demand in ({0: 1}, {1: 1}, {2: 1}):
        use(p, 1, demand)
    assert victim(p, 1, [0, 1, 2]) == 0
    use(p, 1, {0: 5})                 # 0 becomes the most recent
    assert victim(p, 1, [0, 1, 2]) == 1
    assert victim(p, 1, [0, 2]) == 2        # the victim is always one of the candidates
    use(p, 1, {1: 1, 2: 1})           # used together: same clock, ties by lower id
    assert victim(p, 1, [0, 1, 2]) == 0
    assert victim(p, 1, [1, 2]) == 1
    assert victim(p, 1, [7, 1]) == 7        # never used goes first
    assert victim(p, 1, [9, 7]) == 7
    use(p, 2, {5: 1})                 # other layers have their own history
    assert victim(p, 1, [0, 1]) == 0 and victim(p, 2, [5, 0]) == 0


def test_lfu_eviction_order_direct():
    p = LFUPolicy()
    p.setup(ctx(capacity=3))
    for demand in ({0: 1}, {0: 1}, {0: 1}, {1: 1}, {1: 1}, {2: 9}):   # uses: 0x3, 1x2, 2x1 (tokens do not count)
        use(p, 1, demand)
    assert victim(p, 1, [0, 1, 2]) == 2
    use(p, 1, {2: 1})
    use(p, 1, {2: 1})                 # 2 now 3 uses, most recent
    assert victim(p, 1, [0, 1, 2]) == 1
    use(p, 1, {1: 1})                 # all 3 uses: least recently used among equals
    assert victim(p, 1, [0, 1, 2]) == 0
    assert victim(p, 1, [0, 1, 2, 6]) == 6  # never used: 0 uses


def test_lru_through_the_manager():
    llm = tiny("lru", "0.1875")            # 3 slots per layer
    m = llm.engine.manager
    assert m.cache.capacity == 3
    for e in (0, 1, 2):
        rec = scripted_run(m, 1, [[e]])
        assert rec.loads == 1
    assert resident(m, 1) == {0, 1, 2}
    assert scripted_run(m, 1, [[0]]).experts_hit == 1
    rec = scripted_run(m, 1, [[3]])
    assert rec.loads == 1 and resident(m, 1) == {0, 2, 3}          # 1 was least recently used
    scripted_run(m, 1, [[2]])
    scripted_run(m, 1, [[4]])
    assert resident(m, 1) == {2, 3, 4}                                # 0 went
    rec = scripted_run(m, 1, [[5], [6], [4]])                         # two misses: 3 then 2 go, 4 is a hit
    assert (rec.loads, rec.experts_hit) == (2, 1) and resident(m, 1) == {4, 5, 6}
    assert resident(m, 2) == set() and m.cache.evictions[1] == 4


def test_lfu_through_the_manager():
    llm = tiny("lfu", "0.1875")
    m = llm.engine.manager
    for rows in ([[0]], [[0]], [[0]], [[1]], [[1]], [[2]]):
        scripted_run(m, 1, rows)
    assert resident(m, 1) == {0, 1, 2}
    scripted_run(m, 1, [[3]])
    assert resident(m, 1) == {0, 1, 3}     # 2 had the fewest uses
    scripted_run(m, 1, [[4]])
    assert resident(m, 1) == {0, 1, 4}     # 3 (1 use) goes before 1 (2 uses)
    scripted_run(m, 1, [[4]])
    scripted_run(m, 1, [[4]])
    scripted_run(m, 1, [[5]])
    assert resident(m, 1) == {0, 4, 5}     # 1 (2 uses) < 0 (3) = 4 (3)


def test_waves_when_a_layer_needs_more_experts_than_slots():
    llm = tiny("lru", "0.0625")            # 1 slot per layer
    m = llm.engine.manager
    assert m.cache.capacity == 1
    rec = scripted_run(m, 1, [[0], [1], [2], [1]])
    assert rec.loads == 3 and len(resident(m, 1)) == 1
    scripted_run(m, 2, [[3, 4, 5, 6], [6, 7, 8, 9]])      # 7 experts through one slot, output still exact
    assert len(resident(m, 2)) == 1


# ---------------------------------------------------------------------------------------------------- prefetch
def test_prefetch_policy_direct():
    p = PrefetchPolicy()
    p.setup(ctx(capacity=3))
    use(p, 2, {9: 1})
    use(p, 2, {1: 1})                                   # 9 is now the least recently used of layer 2
    d = p.decide(layer_event(1, {0: 1}, {0}, predicted={5: 4, 7: 1, 9: 3, 11: 2}, next_resident={9, 1}))
    assert d.prefetch == [5, 11]                       # top-3 predicted by tokens, minus the resident 9
    assert p.predicted[2] == {5, 9, 11}
    assert first([9, 1], d.prefetch_evict) == 1        # a predicted expert is evicted last, even when it is LRU
    assert victim(p, 2, [9, 1]) == 1
    assert victim(p, 2, [9, 11]) == 11                  # among predicted ones: LRU (11 never used)
    d = p.decide(layer_event(2, {9: 2, 3: 1}, {9, 5, 11}))
    assert (d.load, d.cpu, d.prefetch) == ([3], [], [])                   # misses load on demand
    assert p.predicted[2] == set()                     # the real routing replaced the prediction
    assert list(d.evict) == [3, 5, 11, 9]              # the layer's own order: never used first (by id), then LRU
    assert victim(p, 2, [9, 1]) == 1                    # plain LRU again: 9 was just used
    d = p.decide(layer_event(1, {0: 1}, {0}, predicted={0: 1, 1: 1, 2: 1, 3: 1}, next_resident=set()))
    assert d.prefetch == [0, 1, 2]                                          # at most `capacity`, ties by id


def _router_kwargs(config):
    return dict(top_k=config.top_k, n_group=config.n_group, topk_group=config.topk_group,
                routed_scaling_factor=config.routed_scaling_factor, norm_topk_prob=config.norm_topk_prob)


@pytest.mark.parametrize("preset", ["tiny", "tiny-lladamoe"])
def test_prefetch_predicts_with_the_next_layers_router(preset):
    llm = oled.LLM(random_weights=preset, device="cpu", dtype="float32", expert_budget="0.5", policy="prefetch")
    eng = llm.engine
    m, pol, cfg = eng.manager, eng.policy, eng.config
    layers = cfg.moe_layers
    blocks = {b.layer_idx: b for b in eng.model.moe_blocks()}
    assert set(m.predictors) == set(layers)
    for layer in layers:
        assert m.predictors[layer] == blocks[layer].predicted_routing   # bound method of that layer's MoEBlock

    log = []                                                     # ("run", layer, x) and ("prefetch", layer, ...)
    run, decide = m.run, pol.decide
    predictor_calls = []

    def spy_run(layer, x, ids, w, shared=None):
        log.append(("run", layer, x.detach().clone()))
        return run(layer, x, ids, w, shared)

    def spy_decide(event):
        # everything prefetched for this layer (the top-capacity prediction) is resident when it runs
        assert pol.predicted[event.layer] <= event.resident, (event.layer, pol.predicted[event.layer])
        if event.predicted is not None:
            log.append(("prefetch", event.next_layer, dict(event.predicted), set(event.next_resident)))
        return decide(event)

    def spy_predictor(layer):
        def f(x):
            predictor_calls.append(layer)
            return blocks[layer].route(x)
        return f

    m.run, pol.decide = spy_run, spy_decide
    for layer in layers:
        m.predictors[layer] = spy_predictor(layer)
    llm.generate("hello world, how are you", gen_length=40)

    checked = 0
    for i, entry in enumerate(log):
        if entry[0] != "prefetch":
            continue
        _, nxt, predicted, _ = entry
        prev = log[i - 1]
        assert prev[0] == "run" and layers.index(nxt) == layers.index(prev[1]) + 1   # during layer l, for l+1
        x = prev[2]                                                                  # layer l's MoE input
        blk = blocks[nxt]
        if cfg.router == "sigmoid_group":
            ids, _ = sigmoid_group_route(x, blk.router_weight, blk.expert_bias, **_router_kwargs(cfg))
        else:
            ids, _ = softmax_route(x, blk.router_weight, blk.expert_bias, top_k=cfg.top_k)
        e, c = np.unique(ids.reshape(-1).numpy(), return_counts=True)
        assert predicted == dict(zip(e.tolist(), c.tolist()))
        # ... which is not what layer l's own router would say
        own = blocks[prev[1]].route(x)[0]
        assert not torch.equal(own, ids) or nxt == prev[1]
        checked += 1
    runs = sum(1 for entry in log if entry[0] == "run")
    assert checked == runs // len(layers) * (len(layers) - 1) and checked > 0   # one prediction per layer but last
    assert predictor_calls and set(predictor_calls) == set(layers[1:])           # the first layer is never predicted
    assert sum(r.prefetches for r in m.stats.records) > 0


# -------------------------------------------------------------------------------------------------------- tide
def test_tide_refresh_schedule():
    p = TidePolicy(tau=2)
    p.setup(ctx(capacity=2))
    p.on_request_start()
    due = [p.refresh_due()]                      # prompt prefill: block_step 0
    steps = [(0, False), (1, False), (2, False), (3, True),            # block 0: 4 iterations
             (0, False), (1, False), (2, False), (3, False), (4, True)]  # block 1: 5 iterations
    for it, (step, done) in enumerate(steps):
        due.append(p.refresh_due())              # the forward of this iteration
        p.on_iteration(event(step, it, done))
    # block_step: 0 (prefill) | 0 1 2 3 | 0 1 2 3 4
    assert due == [True, True, False, True, False, True, False, True, False, True]
    p3 = TidePolicy(tau=3)
    p3.setup(ctx())
    p3.on_request_start()
    got = []
    for it, step in enumerate(range(7)):
        got.append(p3.refresh_due())
        p3.on_iteration(event(step, it))
    assert got == [True, False, False, True, False, False, True]


def test_tide_plan_at_refresh_and_between():
    p = TidePolicy(tau=2)
    p.setup(ctx(capacity=3))
    p.on_request_start()
    demand = {4: 5, 1: 2, 7: 5, 2: 2, 9: 1}
    # refresh: desired = top-3 by tokens, ties by lower id: 4, 7 (5 each), then 1 (2, before 2)
    plan = p.decide(layer_event(1, demand, {9, 3}))
    assert plan.load == [4, 7, 1] and sorted(plan.cpu) == [2]
    # victims: outside `desired`, fewest current tokens first (3 has none, 9 has 1); desired ones never
    assert list(plan.evict) == [3, 9]
    plan = p.decide(layer_event(1, {4: 1, 7: 1}, {4, 7, 1}))      # desired all resident: nothing moves
    assert (plan.load, plan.cpu) == ([], [])
    p.on_iteration(event(0, 0))                         # block_step 1: between refreshes
    assert not p.refresh_due()
    plan = p.decide(layer_event(1, {5: 9, 6: 9, 4: 1}, {4, 7, 1}))
    assert plan.load == [] and sorted(plan.cpu) == [5, 6]
    assert list(plan.evict) == []                       # no loads between refreshes, nothing to evict
    p.on_iteration(event(1, 1))                         # block_step 2: refresh again
    plan = p.decide(layer_event(1, {5: 9, 6: 9, 4: 1, 8: 1}, {4, 7, 1}))
    assert plan.load == [5, 6] and sorted(plan.cpu) == [8] and p.refreshes[1] == 3
    p.on_iteration(event(2, 2, block_done=True))        # next block's first iteration
    assert p.refresh_due()
    plan = p.decide(layer_event(2, {3: 1}, set()))      # fewer experts than slots: all of them
    assert (plan.load, plan.cpu) == ([3], [])


def test_tide_through_the_manager():
    llm = tiny("tide", "0.125", tide_tau=2)            # 2 slots per layer, refresh every 2 iterations
    m, p = llm.engine.manager, llm.engine.policy
    assert p.tau == 2 and m.cache.capacity == 2
    m.on_request_start()
    # block start: refresh; 1 (3 tokens) and 2 (2 tokens) are promoted, the rest runs on the CPU
    rec = scripted_run(m, 1, [[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8, 9]])
    assert resident(m, 1) == {1, 2} and (rec.loads, rec.experts_cpu, rec.pairs_cpu) == (2, 7, 7)
    m.on_iteration(event(0, 0))
    # between refreshes: no loads, no evictions, every miss on the CPU
    rec = scripted_run(m, 1, [[3, 4, 5, 6], [3, 4, 7, 8], [3, 4, 1, 9]], seed=1)
    assert resident(m, 1) == {1, 2} and rec.loads == 0 and rec.experts_hit == 1 and rec.experts_cpu == 7
    assert m.cache.evictions[1] == 0
    m.on_iteration(event(1, 1))
    # refresh (block_step 2): desired {3, 4}; 1 is a hit but not desired, 2 is unused: both demoted, 2 first
    rec = scripted_run(m, 1, [[3, 4, 5, 6], [3, 4, 1, 8], [3, 9, 10, 11]], seed=2)
    assert resident(m, 1) == {3, 4}
    assert rec.loads == 2 and m.cache.evictions[1] == 2            # demoted no more than promoted
    assert rec.experts_cpu == 6 and rec.experts_hit == 1
    m.on_iteration(event(2, 2))
    rec = scripted_run(m, 1, [[12, 13, 14, 15]], seed=3)
    assert resident(m, 1) == {3, 4} and rec.experts_cpu == 4
    m.on_iteration(event(3, 3, block_done=True))
    # next block's first iteration: refresh. desired = {0, 5} (2 tokens each). 3 is a hit, computed in the first
    # wave next to the newly loaded 0 (which evicts 4, no tokens); the second wave loads 5 and demotes 3 (not
    # desired): two promoted, two demoted
    rec = scripted_run(m, 1, [[5, 0, 3, 6], [5, 0, 7, 8]], seed=4)
    assert rec.loads == 2 and resident(m, 1) == {5, 0} and m.cache.evictions[1] == 4
    assert resident(m, 2) == set()                                  # layer 2 never ran


def test_tide_keeps_residents_when_demand_is_small():
    llm = tiny("tide", "0.25", tide_tau=4)             # 4 slots
    m = llm.engine.manager
    m.on_request_start()
    scripted_run(m, 2, [[1, 2, 3, 4]])
    assert resident(m, 2) == {1, 2, 3, 4}
    m.on_iteration(event(3, 0, block_done=True))        # next block starts: refresh
    rec = scripted_run(m, 2, [[5, 6, 1, 2]], seed=1)    # desired: top-4 of {1,2,5,6} = all of them
    assert rec.loads == 2 and m.cache.evictions[2] == 2 and resident(m, 2) == {1, 2, 5, 6}
    m.on_iteration(event(0, 1, block_done=True))
    rec = scripted_run(m, 2, [[5, 6, 1, 2]], seed=2)     # all hits: nothing moves
    assert rec.loads == 0 and m.cache.evictions[2] == 2


# ------------------------------------------------------------------------------------------------------- fiddler
def test_fiddler_refuses_without_popularity():
    with pytest.raises(ValueError, match="oled calibrate"):
        make_policy("fiddler")
    with pytest.raises(ValueError, match="oled calibrate"):
        make_policy("fiddler", popularity=None)
    with pytest.raises(ValueError, match="oled calibrate"):
        tiny("fiddler", "0.5")


def test_fiddler_popularity_sources(tmp_path):
    pop = {1: {3: 10, 5: 30, 7: 20, 0: 10}, 2: {15: 1}}
    doc = popularity_document(pop, {"model": "m"})
    assert list(doc["layers"]["1"]) == ["5", "7", "0", "3"]           # most tokens first, ties by id
    path = tmp_path / "pop.json"
    path.write_text(json.dumps(doc))
    for source in (pop, doc, str(path), path, json.loads(json.dumps(doc))):
        got, _ = load_popularity(source)
        assert got == pop
    assert load_popularity(path)[1] == {"model": "m"}
    with pytest.raises(ValueError, match="oled calibrate"):
        load_popularity(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_popularity(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="malformed"):
        load_popularity({"layers": {"1": {"x": 3}}})


def test_fiddler_placement_and_plan():
    p = FiddlerPolicy(popularity={1: {3: 10, 5: 30, 7: 20, 0: 10}, 2: {15: 1}})
    p.setup(ctx(capacity=3))
    assert p.initial_placement(1) == [5, 7, 0]                        # top-3, ties by lower id
    assert p.initial_placement(2) == [15, 0, 1]                        # unseen experts rank last, by id
    plan = p.decide(layer_event(1, {5: 2, 9: 1, 4: 3}, {5, 7, 0}))
    assert plan.load == [] and sorted(plan.cpu) == [4, 9]              # every miss on the CPU, never a load
    assert list(plan.evict) == []
    with pytest.raises(ValueError, match="layer"):
        FiddlerPolicy(popularity={1: {0: 1}}).setup(ctx())             # no data for layer 2
    with pytest.raises(ValueError, match="experts"):
        FiddlerPolicy(popularity={1: {99: 1}, 2: {0: 1}}).setup(ctx())


def test_fiddler_through_the_manager_with_no_resident_expert_needed():
    """Every expert a layer needs is on the CPU: the first wave's grouped compute has no pair to serve (it still runs:
    its shapes are fixed for graphs) and the CPU results fill every row."""
    llm = tiny("fiddler", "0.1875", popularity={1: {0: 5, 1: 4, 2: 3}, 2: {0: 1}}, cpu_threads=1)
    m = llm.engine.manager
    assert resident(m, 1) == {0, 1, 2}
    rec = scripted_run(m, 1, [[5, 6], [6, 9]])
    assert (rec.experts_hit, rec.experts_cpu, rec.pairs_cpu, rec.loads) == (0, 3, 4, 0)
    rec = scripted_run(m, 1, [[0, 6], [9, 1]])                       # half on the GPU, half on the CPU
    assert (rec.experts_hit, rec.experts_cpu) == (2, 2)


def test_calibrate_then_fiddler(tmp_path, capsys):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("the quick brown fox\n\nsome more text\n")
    out = tmp_path / "popularity.json"
    base = ["--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--gen-length", "40"]
    rc = cli_main(["calibrate", *base, "--prompt", "hello world", "--prompts-file", str(prompts_file),
                   "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert set(doc["layers"]) == {"1", "2"}
    prov = doc["provenance"]
    assert prov["model"] == "random:tiny" and prov["policy"] == "full"
    assert prov["prompts"] == ["hello world", "the quick brown fox", "some more text"]
    assert datetime.datetime.fromisoformat(prov["date"]).tzinfo is not None
    totals = {layer: sum(experts.values()) for layer, experts in doc["layers"].items()}
    assert totals["1"] == totals["2"] and totals["1"] % 4 == 0        # every forward routes T*k pairs per layer

    # the same counts with lru at half the experts: routing does not depend on the policy
    out_lru = tmp_path / "pop_lru.json"
    rc = cli_main(["calibrate", *base, "--prompt", "hello world", "--prompts-file", str(prompts_file),
                   "--policy", "lru", "--expert-budget", "0.5", "--out", str(out_lru)])
    assert rc == 0
    assert json.loads(out_lru.read_text())["layers"] == doc["layers"]
    assert cli_main(["calibrate", *base, "--prompt", "x", "--policy", "tide", "--out", str(out_lru)]) == 2
    assert cli_main(["calibrate", *base, "--out", str(out_lru)]) == 2                  # no prompts
    capsys.readouterr()

    ref = tiny("full", "1.0").generate("hello world", gen_length=40)
    for budget in ("0.25", "0.5"):
        llm = tiny("fiddler", budget, popularity=str(out))
        m = llm.engine.manager
        cap = m.cache.capacity
        for layer in TINY_LAYERS:
            pop = {int(e): n for e, n in doc["layers"][str(layer)].items()}
            top = sorted(range(16), key=lambda e: (-pop.get(e, 0), e))[:cap]
            assert resident(m, layer) == set(top)
        placed = {layer: resident(m, layer) for layer in TINY_LAYERS}
        got = llm.generate("hello world", gen_length=40)
        assert got.token_ids == ref.token_ids
        assert {layer: resident(m, layer) for layer in TINY_LAYERS} == placed     # static: nothing moved
        tot = llm.stats()["totals"]
        assert tot["loads"] == 0 and tot["bytes_h2d"] == 0 and tot["pairs_cpu"] > 0
        assert tot["pairs_hit"] + tot["pairs_cpu"] == tot["pairs"]


def test_calibrate_with_a_workload(tmp_path, capsys):
    out = tmp_path / "pop.json"
    rc = cli_main(["calibrate", "--random-weights", "tiny", "--device", "cpu", "--workload", "synthetic:24:2",
                   "--prompt", "hi", "--chat", "--limit", "2", "--gen-length", "8", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    prov = json.loads(out.read_text())["provenance"]
    assert prov["prompts"] == ["hi", "synthetic-24-00"] and prov["chat"] and prov["workload"]["name"]
    assert cli_main(["calibrate", "--random-weights", "tiny", "--workload", "no-such-workload",
                     "--out", str(out)]) == 2
    assert "unknown workload" in capsys.readouterr().err
