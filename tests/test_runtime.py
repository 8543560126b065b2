"""The offload runtime end to end on tiny random-weights models (CPU, fp32):

- the expert budget is never exceeded, after every layer and after every single insert, waves included;
- every GPU-only policy (lru, lfu, prefetch, oled-retain) gives bit-identical logits and tokens to `full`;
- the CPU-using policies (fiddler, tide, oled, oled-coop) give the same tokens as `full` (their CPU kernel sums in another order, so
  logits agree to rounding only);
- the manager refuses policies that break its contract.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import oled
from oled.decoding.kv_cache import KVCache
from oled.policies import ForwardInfo, make_policy
from oled.policies.lru import LRUPolicy
from oled.runtime.budget import parse_budget
from oled.runtime.manager import ExpertManager

from .costs import balanced_costs

PRESETS = ["tiny", "tiny-lladamoe"]          # llada2_moe (2 MoE layers, 16 experts, top-4); lladamoe (2, 8, top-2)
GPU_POLICIES = ["lru", "lfu", "prefetch", "oled-retain"]
CPU_POLICIES = ["fiddler", "tide", "oled", "oled-coop"]
PROMPT = "hello world, how are you today?"
GEN = dict(gen_length=48)                    # two blocks of 32 (the second partly past the end)


def make_llm(preset, policy="full", budget="1.0", **kw):
    return oled.LLM(random_weights=preset, device="cpu", dtype="float32", expert_budget=budget, policy=policy, **kw)


def one_slot(preset) -> str:
    return {"tiny": "0.0625", "tiny-lladamoe": "0.125"}[preset]       # 1 expert slot per MoE layer: waves


@pytest.fixture(scope="module", params=PRESETS)
def reference(request):
    """`full` on the preset: the engine, the tokens of PROMPT, and the popularity of that run (for fiddler)."""
    llm = make_llm(request.param)
    out = llm.generate(PROMPT, **GEN)
    return request.param, llm, out.token_ids, llm.engine.manager.stats.popularity()


# ------------------------------------------------------------------------------------------------ budget checks
class BudgetWatch:
    """Checks the cache invariants after every insert and after every MoE layer the manager runs."""

    def __init__(self, manager):
        self.m, self.cache = manager, manager.cache
        self.checks = 0
        self.max_wave_layers = 0          # layers whose experts on the GPU exceeded the slots (served in waves)
        insert, run = self.cache.insert, manager.run

        def checked_insert(layer, expert):
            slot = insert(layer, expert)
            self.check()
            return slot

        def checked_run(layer, x, ids, weights, shared=None):
            y = run(layer, x, ids, weights, shared)
            self.check()
            if manager.stats.records and manager.stats.records[-1].layer == layer:
                rec = manager.stats.records[-1]
                if rec.experts_hit + rec.loads > self.cache.capacity:
                    self.max_wave_layers += 1
            return y

        self.cache.insert, manager.run = checked_insert, checked_run

    def check(self):
        cache = self.cache
        cap = cache.capacity
        assert cache.pool.shape[0] == cache.budget.slots == cap * len(cache.layers)
        for i, layer in enumerate(cache.layers):
            res = cache.resident(layer)
            slots = list(res.values())
            assert len(res) <= cap, (layer, len(res), cap)
            assert len(set(slots)) == len(slots)
            assert all(i * cap <= s < (i + 1) * cap for s in slots)             # the layer's own slots
            assert set(slots).isdisjoint(cache.free[layer])
            assert len(slots) + len(cache.free[layer]) == cap
        assert cache.resident_bytes <= cache.budget.bytes
        self.checks += 1


def policy_options(policy, popularity):
    return {"popularity": popularity} if policy == "fiddler" else {"tide_tau": 2} if policy == "tide" else {}


@pytest.mark.parametrize("policy", GPU_POLICIES + CPU_POLICIES)
@pytest.mark.parametrize("budget", ["one-slot", "0.25", "0.5"])
def test_budget_never_exceeded_and_tokens_match_full(reference, policy, budget):
    preset, _, ref_tokens, popularity = reference
    spec = one_slot(preset) if budget == "one-slot" else budget
    llm = make_llm(preset, policy, spec, **policy_options(policy, popularity))
    m = llm.engine.manager
    E = m.config.num_experts
    assert m.cache.capacity == {"one-slot": 1, "0.25": E // 4, "0.5": E // 2}[budget]
    watch = BudgetWatch(m)
    pol = llm.engine.policy
    if policy == "tide":                                 # loads only at refreshes
        decide = pol.decide

        def checked_decide(event):
            out = decide(event)
            assert not out.load or pol.refresh_due()
            return out
        pol.decide = checked_decide
    watch.check()                                        # the initial placement too (fiddler)
    out = llm.generate(PROMPT, **GEN)
    assert out.token_ids == ref_tokens, (preset, policy, spec)
    assert watch.checks > 2 * len(m.layers)
    tot = llm.stats()["totals"]
    assert tot["pairs_hit"] <= tot["pairs"]
    assert all(r.resident <= m.cache.capacity for r in m.stats.records)
    if policy in GPU_POLICIES:
        assert tot["pairs_cpu"] == 0 and tot["loads"] > 0
    if policy == "fiddler":
        assert tot["loads"] == 0 and tot["pairs_cpu"] > 0
    if policy == "tide":
        assert tot["pairs_cpu"] > 0 and tot["loads"] > 0
    if budget == "one-slot" and policy not in CPU_POLICIES:
        assert watch.max_wave_layers > 0                 # waves really happened


def test_second_request_on_a_warm_cache(reference):
    preset, _, ref_tokens, popularity = reference
    for policy in ("lru", "tide"):
        llm = make_llm(preset, policy, "0.25", **policy_options(policy, popularity))
        watch = BudgetWatch(llm.engine.manager)
        first = llm.generate("something else entirely", gen_length=20)
        assert llm.generate(PROMPT, **GEN).token_ids == ref_tokens
        assert make_llm(preset).generate("something else entirely", gen_length=20).token_ids == first.token_ids
        assert watch.checks > 0


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_cache_modes(reference, cache):
    preset, ref_llm, _, _ = reference
    ref = ref_llm.generate(PROMPT, gen_length=40, cache=cache).token_ids
    for policy in ("prefetch", "tide"):
        llm = make_llm(preset, policy, "0.25")
        BudgetWatch(llm.engine.manager)
        assert llm.generate(PROMPT, gen_length=40, cache=cache).token_ids == ref, (policy, cache)


@pytest.mark.parametrize("policy", ["lru", "lfu", "prefetch"])     # the baselines that take misses=...
def test_cooperative_misses_give_full_tokens(reference, policy):
    """misses=cooperative: the planner splits each layer's misses between loads and the CPU; tokens stay those of
    `full`, the budget holds, and every layer runs in one wave (loads fit next to the hits)."""
    preset, _, ref_tokens, _ = reference
    llm = make_llm(preset, policy, "0.25")
    eng = llm.engine
    eng.costs = balanced_costs(eng.store.expert_bytes)      # both sides used, whatever this machine measures
    eng.set_runtime(policy, "0.25", misses="cooperative")
    m = eng.manager
    assert m.costs is eng.costs and eng.policy.ctx.costs is eng.costs and m.cpu_kernel is not None
    watch = BudgetWatch(m)
    assert llm.generate(PROMPT, **GEN).token_ids == ref_tokens, (preset, policy)
    tot = llm.stats()["totals"]
    assert tot["loads"] > 0 and tot["pairs_cpu"] > 0, tot
    assert watch.checks > 0 and watch.max_wave_layers == 0
    assert all(r.experts_hit + r.loads <= m.cache.capacity for r in m.stats.records)


def test_cooperative_with_the_measured_cost_model():
    llm = make_llm("tiny", "lru", "0.25", misses="cooperative")
    eng = llm.engine
    assert eng.costs is not None and eng.costs.source.startswith("measured") and eng.policy.ctx.costs is eng.costs
    assert llm.generate(PROMPT, **GEN).token_ids == make_llm("tiny").generate(PROMPT, **GEN).token_ids
    with pytest.raises(ValueError, match="--misses applies to lru, lfu, prefetch and oled-coop"):
        make_llm("tiny", "tide", "0.25", misses="cooperative")


@pytest.mark.parametrize("wake", ["layer", "forward", "off", "auto"])
def test_cpu_workers_are_woken_ahead_of_the_calls(wake):
    """With a CPU policy the kernel's workers are woken before they are needed: at each offloaded layer's routing
    read-back (layer, the default on CUDA), or held through each forward (forward); on a CPU device auto (the
    default) wakes them with each call (off); tokens never depend on it."""
    from oled.runtime.mapped import FORWARD_HOLD_S
    from oled.runtime.round_trip import LAYER_HOLD_S

    llm = make_llm("tiny", "tide", "0.5", cpu_wake=wake)
    kernel = llm.engine.manager.cpu_kernel
    calls, hold = [], kernel.hold
    kernel.hold = lambda seconds: (calls.append(seconds), hold(seconds))
    try:
        out = llm.generate(PROMPT, gen_length=32)
    finally:
        del kernel.hold
    forwards = out.counters["nfe"] + out.counters.get("cache_forwards", 0)
    records = llm.engine.manager.stats.records
    # layer: woken ahead of a layer that had CPU work the last time it ran with as many rows (or never did)
    seen, woken = {}, 0
    for r in records:
        woken += seen.get((r.layer, r.pairs), True)
        seen[r.layer, r.pairs] = r.experts_cpu > 0
    assert 0 < woken < len(records), "the test needs layers with and without CPU work"
    expect = {"layer": [LAYER_HOLD_S] * woken, "forward": [FORWARD_HOLD_S, 0.0] * forwards, "off": [],
              "auto": []}[wake]
    assert llm.engine.manager.cpu_wake == ("off" if wake == "auto" else wake)
    assert calls == expect and forwards > 0
    assert out.token_ids == make_llm("tiny", "tide", "0.5").generate(PROMPT, gen_length=32).token_ids
    with pytest.raises(ValueError, match="cpu_wake must be one of auto, layer, forward, off"):
        make_llm("tiny", "tide", "0.5", cpu_wake="sometimes")


# ----------------------------------------------------------------------------------------------- logits, exact
def _forward(engine, manager, tokens):
    kv = KVCache(engine.config, len(tokens), engine.dtype, engine.device)
    manager.begin_forward(ForwardInfo(kind="iteration", start=0, tokens=len(tokens), block_start=0,
                                      block_length=len(tokens)))
    logits = engine.model(torch.tensor(tokens, dtype=torch.int64), 0, kv, None, slice(None))
    manager.end_forward()
    return logits


def _inputs(engine):
    cfg = engine.config
    rng = np.random.default_rng(0)
    a = engine.tokenizer.encode(PROMPT) + [cfg.mask_token_id] * 24
    b = rng.integers(0, 400, 20).tolist() + [cfg.mask_token_id] * 12
    return [a, b, a]                                     # a third forward on a cache shaped by the second


def _manager(engine, policy, budget, popularity=None, kernel=None):
    spec = parse_budget(budget, num_layers=len(engine.config.moe_layers), num_experts=engine.config.num_experts,
                        expert_bytes=engine.store.expert_bytes)
    pol = make_policy(policy, popularity=popularity, tau=2)
    costs = balanced_costs(engine.store.expert_bytes) if pol.uses_cpu else None   # cooperative: both sides used
    return ExpertManager(engine.store, spec, pol, engine.device, kernel if pol.uses_cpu else None, costs=costs)


def test_logits_bit_identical_to_full(reference):
    preset, ref_llm, _, popularity = reference
    eng = ref_llm.engine
    inputs = _inputs(eng)
    full = eng.manager
    try:
        want = [_forward(eng, full, t) for t in inputs]
        assert torch.equal(want[0], want[2])
        for policy in GPU_POLICIES:
            for budget in (one_slot(preset), "0.25", "0.5"):
                m = _manager(eng, policy, budget)
                eng.runner.attach(m)
                for t, w in zip(inputs, want):
                    got = _forward(eng, m, t)
                    assert torch.equal(got, w), (preset, policy, budget, (got - w).abs().max().item())
                assert sum(r.loads for r in m.stats.records) > 0
        from oled.runtime.cpu_kernel import CpuExpertKernel
        kernel = CpuExpertKernel()
        for policy in CPU_POLICIES:
            for budget in ("0.25", "0.5"):
                m = _manager(eng, policy, budget, popularity, kernel)
                eng.runner.attach(m)
                for t, w in zip(inputs, want):
                    got = _forward(eng, m, t)
                    torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-4)
                    assert torch.equal(got.argmax(-1), w.argmax(-1))
                assert sum(r.pairs_cpu for r in m.stats.records) > 0
                m.close()
        kernel.close()
    finally:
        eng.runner.attach(full)


# ------------------------------------------------------------------------------------------- manager contract
class _BadPlan(LRUPolicy):
    name = "bad-plan"

    def decide(self, event):
        decision = super().decide(event)
        decision.load = decision.load[1:]                # drops a miss
        return decision


class _BadVictim(LRUPolicy):
    name = "bad-victim"

    def decide(self, event):
        decision = super().decide(event)
        decision.evict = [10_000]                        # not resident: nothing it may evict
        return decision


def test_manager_refuses_broken_policies():
    eng = make_llm("tiny").engine
    spec = parse_budget("0.25", num_layers=2, num_experts=16, expert_bytes=eng.store.expert_bytes)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    w = torch.ones(2, 4)
    x = torch.randn(2, eng.config.hidden_size)
    m = ExpertManager(eng.store, spec, _BadPlan(), eng.device)
    with pytest.raises(RuntimeError, match="must split exactly the misses"):
        m.run(1, x, ids, w)
    m = ExpertManager(eng.store, spec, _BadVictim(), eng.device)
    with pytest.raises(RuntimeError, match="no expert of layer 1 to evict"):
        m.run(1, x, ids, w)
    with pytest.raises(ValueError, match="CPU"):
        ExpertManager(eng.store, spec, make_policy("tide"), eng.device, cpu_kernel=None)


def test_the_residents_view_follows_every_change_of_the_slot_table():
    """Residency.residents is made once per version of a layer's slot table: a change made straight on the
    ExpertCache (insert, capture, evict), not through Residency, still shows in the next view; no change, the same
    objects."""
    from oled.policies import make_policy
    from oled.runtime.budget import ExpertBudget
    from oled.runtime.expert_cache import ExpertCache
    from oled.runtime.residency import Residency
    from oled.runtime.stats import RunStats

    budget = ExpertBudget(slots_per_layer=4, num_layers=2, expert_bytes=1, total_expert_bytes=16)
    cache = ExpertCache([1, 2], budget, 1, None, "meta", 8)
    res = Residency(cache, make_policy("lru"), RunStats(), num_experts=8, top_k=2, expert_bytes=1)
    empty, _ = res.residents(1)
    cache.insert(1, 5)
    resident, ids = res.residents(1)
    assert empty == frozenset() and resident == {5} and ids.tolist() == [5]
    assert res.residents(1)[0] is resident                      # nothing changed: the same view
    cache.insert_at(1, 3, cache.free[1][0])
    cache.evict(1, 5)
    resident, ids = res.residents(1)
    assert resident == {3} and ids.tolist() == [3] and not ids.flags.writeable
    assert res.residents(2)[0] == frozenset() and cache.version == {1: 3, 2: 0}


def test_the_cache_keeps_its_slot_tables_as_an_array():
    """ExpertCache.table (from which the device slot map is written) equals the slot tables after every insert,
    capture and eviction, in random order."""
    import random

    from oled.runtime.budget import ExpertBudget
    from oled.runtime.expert_cache import ExpertCache

    rng = random.Random(0)
    budget = ExpertBudget(slots_per_layer=3, num_layers=2, expert_bytes=1, total_expert_bytes=20)
    cache = ExpertCache([4, 7], budget, 1, None, "meta", 10)
    done = {"evict": 0, "insert": 0, "insert_at": 0}
    for step in range(200):
        layer = rng.choice([4, 7])
        resident = cache.resident(layer)
        absent = [e for e in range(10) if e not in resident]
        if resident and (not cache.has_free_slot(layer) or rng.random() < 0.4):
            cache.evict(layer, rng.choice(sorted(resident)))
            done["evict"] += 1
        elif rng.random() < 0.5:
            cache.insert(layer, rng.choice(absent))
            done["insert"] += 1
        else:
            cache.insert_at(layer, rng.choice(absent), rng.choice(cache.free[layer]))
            done["insert_at"] += 1
        for pos, lay in enumerate(cache.layers):
            expected = [-1] * 10
            for e, slot in cache.resident(lay).items():
                expected[e] = slot
            assert cache.table[pos].tolist() == expected, (step, lay)
    assert min(done.values()) > 20


@pytest.mark.parametrize("policy", ["lru", "oled-retain", "oled", "tide"])
def test_a_budget_that_holds_every_expert_records_the_event_paths_statistics_without_asking_the_policy(policy):
    """At a budget that holds every expert (the all-resident path) no event reaches the policy (its decide would
    have nothing to load or evict), and each layer's statistics equal what the event path records for the same
    routing: pairs, experts, hits, tokens per expert, residents and residents used."""
    from oled.runtime.budget import ExpertBudget
    from oled.runtime.expert_cache import ExpertCache
    from oled.runtime.residency import Residency
    from oled.runtime.stats import RunStats

    def residency(pol):
        budget = ExpertBudget(slots_per_layer=8, num_layers=2, expert_bytes=1, total_expert_bytes=16)
        res = Residency(ExpertCache([1, 2], budget, 1, None, "meta", 8), pol, RunStats(), num_experts=8, top_k=2,
                        expert_bytes=1, costs=balanced_costs(1))
        res.place_initial()
        return res

    class NoEvents(type(make_policy(policy))):
        def decide(self, event):
            raise AssertionError("a layer event on the all-resident path")

        def on_forward(self, info):
            raise AssertionError("a forward's event on the all-resident path")

        def on_iteration(self, event):
            raise AssertionError("an iteration's event on the all-resident path")

    rng = np.random.default_rng(0)
    recorded, evented = residency(NoEvents()), residency(make_policy(policy))
    assert recorded.all_resident and recorded.holds_everything
    for forward in range(3):
        info = ForwardInfo(kind="iteration", start=0, tokens=5, block_start=0, block_length=5)
        recorded.begin_resident_forward(info)
        evented.begin_forward(info)
        for layer in (1, 2):
            ids = np.stack([rng.choice(8, 2, replace=False) for _ in range(5)])
            recorded.record_resident(layer, ids)
            evented.end_layer(evented.begin_layer(layer, ids, np.full(ids.shape, 0.5, np.float32)))
    rows, expected = recorded.stats.to_rows(), evented.stats.to_rows()
    assert len(rows) == 6 and rows == expected
    assert all(r["pairs_hit"] == r["pairs"] == 10 and r["resident"] == 8 for r in rows)
