"""The CPU's share of a mapped forward's misses (EngineConfig.cpu_share, runtime/cpu_share.py): the table from the
planner's objective, the rule by expert id, and the engine on the tiny model through Triton's interpreter (fp32):
full's tokens with every cooperative policy, every pair a hit, a GPU read or a CPU pair, the CPU's experts never
captured, and a trace that replays the live decisions exactly."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from oled.runtime.cost_model import CostModel
from oled.runtime.cpu_share import ShareHold, cpu_share_experts, cpu_share_table
from oled.runtime.planner import PlanInputs, plan_cost
from tests.test_mapped import PROMPT, _generate, _llm, full_block, kernels  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]


def costs(cpu_us: float, copy_gbps: float, call_us: float = 20.0, transfer_us: float = 10.0) -> CostModel:
    return CostModel(expert_bytes=6 << 20, h2d_gbps=copy_gbps, cpu_seconds={1: cpu_us * 1e-6, 4: 2 * cpu_us * 1e-6},
                     cpu_call_seconds=call_us * 1e-6, cpu_slowdown_with_copies=1.2, gpu_seconds={1: 5e-6},
                     copy_slowdown_with_cpu=1.1, transfer_seconds=transfer_us * 1e-6)


@pytest.mark.parametrize("cpu_us, gbps", [(150.0, 50.0), (60.0, 50.0), (400.0, 50.0), (100.0, 10.0), (1e5, 50.0)])
def test_the_table_is_the_best_count_of_the_planners_objective(cpu_us, gbps):
    """table[m] is the number of CPU experts that minimises the planner's objective for m one-token misses (brute
    force over every count; ties to fewer CPU experts, as the planner breaks them); 0 for no miss."""
    model = costs(cpu_us, gbps)
    table = cpu_share_table(model, 40)
    assert table.dtype == np.int32 and table.shape == (41,) and table[0] == 0
    for m in range(1, 41):
        tokens = {e: 1 for e in range(m)}
        cost = [plan_cost(list(range(m - c)), list(range(m - c, m)), PlanInputs(tokens=tokens), model)
                for c in range(m + 1)]
        best = min(cost)
        assert cost[table[m]] == pytest.approx(best, rel=1e-12), m
        assert all(c > best * (1 + 1e-12) for c in cost[: table[m]]), m


def test_the_table_follows_the_costs():
    """A slow CPU takes nothing; a fast CPU beside a slow link takes most; a layer of one miss keeps it on the GPU
    where the CPU's call and transfer alone cost more than the read."""
    assert not cpu_share_table(costs(1e5, 50.0), 64).any()
    fast = cpu_share_table(costs(20.0, 5.0), 64)
    assert (fast[2:] >= np.arange(2, 65) // 2).all()
    even = cpu_share_table(costs(150.0, 50.0), 64)          # a read ~126 us, a CPU expert 150 us + 30 us fixed
    assert even[1] == 0 and 0 < even[64] < 64
    assert (np.diff(even) >= 0).all()                      # more misses never give the CPU fewer


def test_the_table_prices_a_miss_as_the_kernels_read_it():
    """On the mapped path a miss costs the GPU its read inside the kernels (CostModel.mapped_reads), not a copy and a
    computation: where that read is cheap (small experts, whose copies pay a fixed cost a kernel's read does not)
    the CPU takes nothing that the copy's price gave it; where it is as dear as the copy, the same counts; not
    measured, the copy's price stands."""
    slow_copies = costs(20.0, 5.0)                            # a 6 MiB copy 1.26 ms, a CPU expert 20 us
    assert cpu_share_table(slow_copies, 64)[2:].all()
    cheap = replace(slow_copies, mapped_seconds=2e-6)         # read inside the kernels in 2 us
    view = cheap.mapped_reads()
    assert view.load_seconds(3) == pytest.approx(6e-6) and view.gpu_expert_seconds(1) == 0.0
    assert view.cpu_seconds == cheap.cpu_seconds and view.transfer_seconds == cheap.transfer_seconds
    assert not cpu_share_table(view, 64).any()
    even = replace(costs(150.0, 50.0), gpu_seconds={})
    as_copied = replace(even, mapped_seconds=even.load_seconds(1))
    assert 0 < cpu_share_table(even, 64)[64] < 64
    assert np.array_equal(cpu_share_table(as_copied.mapped_reads(), 64), cpu_share_table(even, 64))
    assert slow_copies.mapped_reads() is slow_copies
    assert CostModel.from_dict(cheap.to_dict()) == cheap       # the measured term survives the cache file


def test_the_cpu_takes_the_highest_ids_the_slots_cannot_keep():
    """table[m] of the m misses, highest ids first, at most m and at most demanded - capacity (the misses the slots
    cannot keep beside the layer's hits)."""
    table = np.array([0, 0, 1, 1, 2, 9], dtype=np.int32)
    assert cpu_share_experts([7, 3], table, 20, 10) == [7]
    assert cpu_share_experts([9, 1, 4, 30], table, 20, 10) == [9, 30]
    assert cpu_share_experts([2, 5, 1, 8, 6], table, 20, 10) == [1, 2, 5, 6, 8]    # capped at m
    assert cpu_share_experts([], table, 20, 10) == [] and cpu_share_experts([4], table, 20, 10) == []
    assert cpu_share_experts([9, 1, 4, 30], table, 11, 10) == [30]          # one miss the slots cannot keep
    assert cpu_share_experts([9, 1, 4, 30], table, 10, 10) == []            # the slots keep them all



def test_the_workers_are_held_through_a_forward_only_after_one_with_cpu_work():
    hold = ShareHold()
    assert hold.begin()                                 # no forward yet: held, as a forward with a share
    assert not hold.layer([]) and not hold.layer([3])   # held already: nothing to do at its first CPU layer
    assert hold.end()                                   # released
    assert hold.begin() and not hold.layer([]) and hold.end()
    assert not hold.begin()                             # the last forward gave the CPU nothing: not held
    assert not hold.layer([]) and hold.layer([5, 9])    # until its first layer with a share, then held on
    assert not hold.layer([1]) and hold.end()
    assert hold.begin() and hold.end()
    assert not hold.begin() and not hold.layer([]) and not hold.end()   # nothing held, nothing to release

@pytest.fixture
def half_to_cpu(monkeypatch):
    """A table giving the CPU half of every layer's misses, rounded up (on this machine the measured costs may give
    it none): the engine and its replays read it through Residency."""
    import oled.runtime.residency as residency

    monkeypatch.setattr(residency, "cpu_share_table",
                        lambda costs, E, rows=0: np.array([(m + 1) // 2 for m in range(E + 1)], dtype=np.int32))


@pytest.mark.parametrize("policy,budget,options", [("oled", "0.4", {}), ("oled-coop", "0.3", {}),
                                                   ("lru", "0.4", {"misses": "cooperative"}), ("tide", "0.5", {})])
def test_cooperative_policies_give_the_tokens_of_full(kernels, full_block, half_to_cpu, policy, budget, options):
    """The CPU's share changes where misses are computed, not the tokens (fp32); every pair of an iteration is a hit,
    a GPU read or a CPU pair; the CPU's experts follow the rule on the slot tables; no combine gave up waiting."""
    llm = _llm(policy, budget, cpu_share=True, **options)
    manager = llm.engine.manager
    assert manager.cpu_share and manager.mapped
    assert _generate(llm, gen_length=8) == full_block
    iterations = [r for r in manager.stats.records if r.kind == "iteration"]
    assert sum(r.pairs_cpu for r in iterations) > 0 and sum(r.pairs_mapped for r in iterations) > 0
    capacity = manager.cache.capacity
    for r in iterations:
        assert r.pairs_hit + r.pairs_mapped + r.pairs_cpu == r.pairs
        assert r.experts_hit + r.experts_mapped + r.experts_cpu == r.experts
        misses = r.experts_mapped + r.experts_cpu
        assert r.experts_cpu == min((misses + 1) // 2, max(0, r.experts - capacity))
        assert r.experts_captured <= r.experts_mapped      # the CPU's experts are never captured
        # the GPU's misses load first: a CPU expert loads only where every miss the GPU read did
        assert r.loads <= capacity - r.experts_hit
    assert manager.mapped_path.share_errors.item() == 0
    assert all(share.done.item() in (0, 1) for share in manager.mapped_path.shares.values())


def test_a_policy_that_loads_every_miss_gets_no_share(kernels, half_to_cpu):
    llm = _llm("lru", "0.4", cpu_share=True)
    assert llm.engine.manager.mapped and not llm.engine.manager.cpu_share


def test_a_combine_that_gave_up_fails_the_forward(kernels, half_to_cpu):
    manager = _llm("oled", "0.4", cpu_share=True).engine.manager
    manager.mapped_path.check_share()                                 # nothing wrong: no error
    manager.mapped_path.share_errors.fill_(2)
    with pytest.raises(RuntimeError, match="stopped waiting for the CPU's share"):
        manager.mapped_path.check_share()
    assert manager.mapped_path.share_errors.item() == 0


def test_a_trace_with_a_cpu_share_replays_exactly(kernels, half_to_cpu):
    """The trace records the share (live.cpu_share), and a replay makes the live run's decisions: every layer
    record's counters equal, CPU pairs included; replayed without the share, its misses are all GPU reads."""
    from oled.decoding.params import DecodeParams
    from oled.runtime.stats import TIMINGS
    from oled.trace import record_trace, replay

    llm = _llm("oled", "0.4", cpu_share=True, capture_slots=2)
    trace, _ = record_trace(llm.engine, [("p", llm.tokenizer.encode(PROMPT))],
                            DecodeParams(gen_length=16, block_length=8))
    assert trace.header["live"]["cpu_share"] is True
    live = [{k: v for k, v in r.items() if k not in TIMINGS} for r in llm.engine.manager.stats.to_rows()]
    replayed = replay(trace, "oled", trace.header["live"]["expert_budget"])
    rows = [{k: v for k, v in r.items() if k not in TIMINGS} for r in replayed.stats.to_rows()]
    assert rows == live and sum(r["pairs_cpu"] for r in rows) > 0
    plain = replay(trace, "oled", trace.header["live"]["expert_budget"], cpu_share=False).stats.to_rows()
    assert sum(r["pairs_cpu"] for r in plain if r["kind"] == "iteration") == 0


def test_the_gpus_misses_load_first_and_the_cpus_are_left_out(half_to_cpu):
    """A layer of 8 slots holding 5 experts, routed to 4 of them and to 6 misses: demanded 10 > 8 slots, so the CPU
    takes the 2 highest-id misses (the table's 3, limited to 10 - 8); the policy loads every miss it can, most rows
    first, into the 4 slots not holding a hit (one wave): the 4 the GPU read load, not the CPU's, even where they
    have more rows."""
    from oled.policies import make_policy
    from oled.runtime.budget import ExpertBudget
    from oled.runtime.expert_cache import ExpertCache
    from oled.runtime.residency import Residency
    from oled.runtime.stats import RunStats

    budget = ExpertBudget(slots_per_layer=8, num_layers=1, expert_bytes=1, total_expert_bytes=16)
    policy = make_policy("lru", misses="cooperative")
    res = Residency(ExpertCache([1], budget, 1, None, "meta", 16), policy, RunStats(), num_experts=16, top_k=2,
                    expert_bytes=1, costs=costs(150.0, 50.0), mapped_rows=16, cpu_share=True)
    for e in (0, 1, 2, 3, 4):
        res.cache.insert(1, e)
    # tokens: hits 0-3; misses 8-13, the CPU's (12, 13) with the most rows
    ids = np.array([[0, 12], [1, 12], [2, 13], [3, 13], [12, 8], [13, 9], [12, 10], [13, 11]])
    assert res.mapped_cpu_share(1, ids) == [12, 13]
    wave = res.decide_mapped(1, ids, np.ones(ids.shape, np.float32))
    assert sorted(wave.loads) == [8, 9, 10, 11]
    rec = res.stats.records[-1]
    assert (rec.experts_cpu, rec.pairs_cpu, rec.experts_mapped, rec.pairs_mapped) == (2, 8, 4, 4)


@pytest.mark.parametrize("share", [True, False])
def test_the_engine_holds_the_workers_after_forwards_with_cpu_work(kernels, monkeypatch, share):
    """The manager's ShareHold sees every mapped forward: with a share in every layer with misses, each forward
    after one with CPU work is held; with a table that gives the CPU nothing, only the first."""
    import oled.runtime.residency as residency

    monkeypatch.setattr(residency, "cpu_share_table", lambda costs, E, rows=0: np.array(
        [(m + 1) // 2 if share else 0 for m in range(E + 1)], dtype=np.int32))
    llm = _llm("oled", "0.4", cpu_share=True)
    manager = llm.engine.manager
    seen = []                                           # per mapped forward: [held from its start, a CPU layer]
    begin, layer = manager.mapped_path.share_hold.begin, manager.mapped_path.share_hold.layer

    def begin_logged():
        seen.append([begin(), False])
        return seen[-1][0]

    def layer_logged(cpu):
        seen[-1][1] |= bool(cpu)
        return layer(cpu)
    monkeypatch.setattr(manager.mapped_path.share_hold, "begin", begin_logged)
    monkeypatch.setattr(manager.mapped_path.share_hold, "layer", layer_logged)
    _generate(llm, gen_length=8)
    assert len(seen) > 2 and seen[0][0]
    assert [held for held, _ in seen[1:]] == [cpu for _, cpu in seen[:-1]]
    assert any(cpu for _, cpu in seen) == share
