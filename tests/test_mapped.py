"""Mapped misses (EngineConfig.mapped_misses, runtime/mapped.py): a denoising iteration's misses computed by the
fused MoE kernels from the expert store in host memory, with no host step inside the forward; the policy decides from
each layer's routing once the forward is queued, and its loads fill slots for the next forwards. On the CPU through
Triton's interpreter (tiny models, fp32): every policy gives `full`'s tokens, each forward starts with the device slot
map equal to the host's slot tables, the statistics split every pair into a hit or a mapped miss, and the other
forwards (prefill, cache fills) keep the host round trip."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.triton_interpreter import import_triton_for_the_interpreter, interpreted_kernels
from tests.scripts import benchmark_script

triton = import_triton_for_the_interpreter()

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

PROMPT = "def fib(n):\n"


@pytest.fixture(scope="module")
def kernels():
    mp = interpreted_kernels("kernel_math", "moe_align_kernel", "moe_kernel")
    yield
    mp.undo()


def _llm(policy, budget, mapped=True, **kw):
    import oled

    return oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy=policy, expert_budget=budget,
                    fused_moe=True, mapped_misses=mapped, **kw)


def _generate(llm, gen_length=16, block_length=8):
    """Two blocks: their iterations, and the cache fill between them (the first block's K/V with the second's
    first iteration), each forward through Triton's interpreter."""
    from oled.decoding.params import DecodeParams

    ids = llm.tokenizer.encode(PROMPT)
    return llm.engine.generate_ids(ids, DecodeParams(gen_length=gen_length, block_length=block_length)).token_ids


def _assert_slot_map_is_the_tables(manager, where):
    """Each layer's row of the device slot map (and the host's mirror of it) lists exactly the slot tables' experts."""
    for pos, layer in enumerate(manager.layers):
        row = np.full(manager.config.num_experts, -1)
        for e, slot in manager.cache.resident(layer).items():
            row[e] = slot
        assert np.array_equal(manager.slots.slot_map[pos].numpy(), row), (where, layer)
        assert np.array_equal(manager.slots.slot_map[pos].numpy(), manager.slots.ready[pos]), (where, layer)


@pytest.fixture(scope="module")
def full_tokens(kernels):
    return _generate(_llm("full", "1.0", mapped=False))


@pytest.fixture(scope="module")
def full_block(kernels):
    """full's tokens for one block of 8 (the policy sweep's generate, half the forwards of _generate's)."""
    return _generate(_llm("full", "1.0", mapped=False), gen_length=8)


# one policy of each kind of mapped decision: loads (lru), oled's retention, a cooperative split (oled-coop; as
# lru:misses=cooperative's), no prediction (prefetch), CPU misses not loaded (tide)
@pytest.mark.parametrize("policy,budget,options", [("lru", "0.5", {}), ("oled", "0.5", {}), ("oled-coop", "0.3", {}),
                                                   ("prefetch", "0.5", {}), ("tide", "0.5", {})])
def test_every_policy_gives_the_tokens_of_full(kernels, full_block, policy, budget, options):
    """No pair is computed on the CPU and a pair's bits do not depend on where its expert's weights were read, so
    every policy decodes full's tokens; each forward starts with the device slot map equal to the slot tables. A
    cooperative split has nothing to split (every miss was served): its misses are loaded."""
    llm = _llm(policy, budget, **options)
    manager = llm.engine.manager
    assert manager.mapped and not manager.all_resident
    checked = []
    residency_begin = manager.residency.begin_forward

    def begin_forward(info, **kw):          # after the manager settled the copies decided in the last forward
        _assert_slot_map_is_the_tables(manager, info)
        checked.append(info.kind)
        return residency_begin(info, **kw)

    manager.residency.begin_forward = begin_forward
    assert _generate(llm, gen_length=8) == full_block
    assert checked.count("iteration") >= 2
    summary = manager.stats.summary()
    assert summary["cpu_pairs_per_iteration"] == 0
    assert summary["mapped_pairs_per_iteration"] > 0 and summary["loads_per_iteration"] > 0
    # every routing buffer a mapped forward wrote is unset once read, and a new
    # request unsets what a forward cut short would have left
    from oled.runtime.mapped import MAPPED_UNSET
    buffers = list(manager.mapped_path.buffers.values())
    assert buffers and all((b == MAPPED_UNSET).all() for b in buffers)
    buffers[0].numpy().fill(3)
    manager.on_request_start()
    assert (buffers[0] == MAPPED_UNSET).all()


def test_each_pair_is_a_hit_or_a_mapped_miss_and_loads_fit_beside_the_hits(kernels, full_block):
    llm = _llm("lru", "0.4")
    assert _generate(llm, gen_length=8) == full_block
    manager = llm.engine.manager
    capacity, expert_bytes = manager.cache.capacity, manager.store.expert_bytes
    iterations = [r for r in manager.stats.records if r.kind == "iteration"]
    assert iterations and any(r.pairs_mapped for r in iterations)
    for r in iterations:
        assert r.pairs_hit + r.pairs_mapped == r.pairs and r.experts_hit + r.experts_mapped == r.experts
        assert r.pairs_cpu == r.experts_cpu == 0
        # one wave: loads beside the layer's hits; the kernels read a missed blob once per 16 of its pairs
        assert r.loads <= capacity - r.experts_hit and r.loads <= r.experts_mapped
        assert r.experts_mapped * expert_bytes <= r.bytes_mapped <= r.pairs_mapped * expert_bytes
        assert r.bytes_h2d == r.loads * expert_bytes

@pytest.mark.parametrize("policy,budget", [("lru", "0.5")])
def test_captured_misses_are_resident_with_their_weights_and_cross_pcie_once(kernels, full_block, policy, budget):
    """capture_slots: the kernels write the misses they read from host memory into the armed slots, and the
    host makes them resident without a copy. Before every forward each resident expert's slot holds its blob and the
    device slot map equals the tables; the tokens are full's; the same routing copies fewer experts than without
    capture; every forward after the first arms R slots a layer (free ones, then its next victims'); and the device
    state (slot map and capture table) is written in one copy a forward at most."""
    import torch

    plain = _llm(policy, budget, capture_slots=0)
    assert _generate(plain, gen_length=8) == full_block
    llm = _llm(policy, budget, capture_slots=2)
    manager = llm.engine.manager
    R = manager.residency.capture_slots
    assert R == 2 and manager.slots.capture_table is not None
    armed_full = []
    arm = manager.residency.arm_capture
    prepare = manager.slots.prepare
    write, writes = manager.slots.write, []

    def write_device_state():
        writes[-1] += 1
        write()

    def prepare_device(mapped, armed=None):     # the device state the next forward reads, written in one copy
        writes.append(0)
        prepare(mapped, armed)
        for pos, layer in enumerate(manager.layers):
            for e, slot in manager.cache.resident(layer).items():
                assert torch.equal(manager.cache.pool[slot], manager.store.blob(layer, e)), (layer, e, slot)
            assert np.array_equal(manager.slots.slot_map[pos].numpy(), manager.slots.ready[pos])
            assert np.array_equal(manager.slots.capture_table[pos].numpy(), manager.slots.capture_host[pos])
        if mapped:
            # armed layer by layer as the decisions came (armed given) or all at once: the same table as arming
            # every layer afresh from the slots as they are now
            table, armed_now = manager.slots.capture_host.copy(), dict(manager.residency.armed)
            afresh = arm(True)
            assert manager.residency.armed == armed_now
            for layer, slots in afresh.items():
                row = table[manager.layer_pos[layer]]
                assert row[: len(slots)].tolist() == slots and (row[len(slots):] == -1).all(), (layer, row, slots)
            armed_full.append(all(len(slots) == R for slots in afresh.values()))
            prepared_after_decisions.append(armed is not None)

    prepared_after_decisions = []
    manager.slots.prepare = prepare_device
    manager.slots.write = write_device_state
    assert _generate(llm, gen_length=8) == full_block
    records = [r for r in manager.stats.records if r.kind == "iteration"]
    captured = sum(r.experts_captured for r in records)
    assert captured > 0 and all(r.experts_captured <= min(R, r.experts_mapped) for r in records)
    copied = sum(r.loads for r in records)
    assert copied < sum(r.loads for r in plain.engine.manager.stats.records if r.kind == "iteration")
    assert sum(armed_full) >= len(armed_full) - 1 > 0       # the first after the prefill has no victims yet
    assert any(prepared_after_decisions)    # a mapped forward's decisions armed its layers for the next one
    assert max(writes) == 1 and sum(writes) >= len(writes) // 2     # one copy a forward at most, most forwards
    assert manager.stats.summary()["captured_experts_per_iteration"] == captured / len(
        {r.forward for r in records})


def test_a_policy_that_never_loads_arms_no_capture():
    """fiddler's placement is static: it would capture nothing, so its mapped path runs without the capture logic,
    while a policy that loads keeps the slots asked for."""
    from oled.policies import make_policy
    from oled.runtime.budget import ExpertBudget
    from oled.runtime.expert_cache import ExpertCache
    from oled.runtime.residency import Residency
    from oled.runtime.stats import RunStats

    budget = ExpertBudget(slots_per_layer=8, num_layers=1, expert_bytes=1, total_expert_bytes=16)
    kept = {}
    for name, options in (("lru", {}), ("fiddler", {"popularity": {"1": {"3": 5}}})):
        policy = make_policy(name, **options)
        res = Residency(ExpertCache([1], budget, 1, None, "meta", 16), policy, RunStats(), num_experts=16, top_k=2,
                        expert_bytes=1, mapped_rows=16, capture_slots=4)
        kept[name] = res.capture_slots
    assert kept == {"lru": 4, "fiddler": 0}


def test_a_prefill_keeps_the_host_round_trip_and_reads_cpu_misses_from_host_memory(kernels):
    """A prefill takes the host round trip (it copies most of its misses once); the misses its policy sends to the
    CPU (fiddler: every miss outside the static placement) are read from host memory by the first wave instead, so
    no pair is computed on the CPU and the tokens are full's. An iteration with more than 16 pairs an expert on
    average would take the host round trip too."""
    from oled.decoding.params import DecodeParams
    from oled.policies.base import ForwardInfo

    prompt_text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    params = DecodeParams(gen_length=8, block_length=8)
    llm = _llm("full", "1.0", mapped=False)
    prompt = llm.tokenizer.encode(prompt_text)
    want = llm.engine.generate_ids(prompt, params).token_ids
    llm.engine.cfg.mapped_misses = True
    llm.engine.set_runtime("fiddler", "0.5", popularity=llm.engine.manager.stats.popularity())
    manager, config = llm.engine.manager, llm.engine.config
    assert manager.mapped
    assert llm.engine.generate_ids(prompt, params).token_ids == want
    prefill = [r for r in manager.stats.records if r.kind == "prefill"]
    assert prefill and sum(r.pairs_mapped for r in prefill) > 0
    assert all(r.pairs_cpu == 0 and r.pairs_hit + r.pairs_mapped == r.pairs for r in prefill)
    iterations = [r for r in manager.stats.records if r.kind == "iteration"]
    assert sum(r.pairs_mapped for r in iterations) > 0 and all(r.pairs_cpu == 0 for r in iterations)
    limit = config.num_experts * 16 // config.top_k

    def info(kind, tokens):
        return ForwardInfo(kind=kind, start=0, tokens=tokens, block_start=0, block_length=16)

    assert manager.residency.takes_mapped_path(info("iteration", limit))
    assert not manager.residency.takes_mapped_path(info("iteration", limit + 1))
    assert not manager.residency.takes_mapped_path(info("prefill", 16))


def test_a_miss_loaded_after_one_iteration_is_a_hit_in_the_next(kernels):
    """The loads a layer's decision makes in one iteration are resident when the layer runs in the next forward: a
    miss the policy loaded and the next iteration needs again is a hit there (one forward's lag, not two)."""
    llm = _llm("lru", "0.5")
    manager = llm.engine.manager
    seen = {}
    end_layer = manager.residency.end_layer

    def record(step):
        end_layer(step)
        misses = set(step.demand) - set(step.hits)
        seen[manager.stats.forward, step.layer] = (manager.stats.kind, set(step.demand), set(step.hits),
                                                   misses & set(manager.cache.resident(step.layer)))

    manager.residency.end_layer = record
    _generate(llm, gen_length=8)
    reused = 0
    for (f, layer), (kind, _, _, loaded) in seen.items():
        following = seen.get((f + 1, layer))
        if kind != "iteration" or following is None or following[0] != "iteration":
            continue
        again = loaded & following[1]
        assert again <= following[2], (f, layer)
        reused += len(again)
    assert reused > 0


def test_mapped_misses_need_the_fused_kernels(kernels):
    import oled

    with pytest.raises(ValueError, match="fused"):
        oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="lru", expert_budget="0.5",
                 fused_moe=False, mapped_misses=True)


def test_a_budget_holding_every_expert_ignores_mapped_misses(kernels):
    """Every expert resident: the all-resident path (one graph, no host step), whose tokens test_triton_moe checks."""
    llm = _llm("lru", "1.0")
    assert llm.engine.manager.all_resident and not llm.engine.manager.mapped


def test_the_policy_bookkeeping_of_a_mapped_forward_runs_behind_its_launch(kernels, full_tokens):
    """On the mapped path the iteration event and the forward's start reach the policy once the next forward is
    queued (its decisions come from the routing read back after the launch), so the GPU does not wait on them; before
    a forward that decides as it runs (a cache fill on the host round trip), they come first. Tokens stay full's."""
    llm = _llm("oled", "0.4")
    manager = llm.engine.manager
    log = []

    def wrap(obj, name, entry):
        inner = getattr(obj, name)

        def logged(*a, **k):
            log.append(entry(*a, **k) if callable(entry) else entry)
            return inner(*a, **k)
        setattr(obj, name, logged)
    wrap(manager, "launched", "launch")
    wrap(manager.policy, "on_iteration", "event")
    wrap(manager.residency, "begin_forward", lambda info, **k: "start " + info.kind)
    wrap(manager.residency, "begin_layer", lambda *a, misses_served=False, **k: "mapped" if misses_served else "round trip")
    takes_mapped_path, forwards = manager.residency.takes_mapped_path, []

    def every_third_on_the_round_trip(info):     # both paths are exact: the choice only moves the bookkeeping
        forwards.append(info)
        return takes_mapped_path(info) and len(forwards) % 3 != 0
    manager.residency.takes_mapped_path = every_third_on_the_round_trip
    assert _generate(llm) == full_tokens
    behind = ahead = 0
    for i, entry in enumerate(log):
        if entry != "event":
            continue
        start = next((j for j in range(i, len(log)) if log[j].startswith("start")), None)
        if start is None:           # the request's last event: done as the loop ends
            continue
        decision = next((log[j] for j in range(start, len(log)) if log[j] in ("mapped", "round trip")), None)
        if decision == "mapped":
            assert log[i - 1] == "launch" and log[start] == "start iteration", log[i - 2:start + 2]
            behind += 1
        else:
            assert "launch" not in log[i:start + 1], log[i - 2:start + 2]
            ahead += 1
    assert behind > 0 and ahead > 0


def test_a_mapped_forward_finds_its_device_state_set_behind_the_forward_before(kernels, full_block):
    """The last mapped forward's decisions settle the slot map and arm the capture table for the next forward (while
    the GPU finishes), so a mapped forward after a mapped one starts with nothing to set; a forward of the other path
    sets its own. Every forward starts with the device slot map equal to the tables and, on the mapped path, the
    capture table equal to the armed slots; tokens stay full's."""
    llm = _llm("lru", "0.5", capture_slots=2)
    manager = llm.engine.manager
    takes_mapped_path, begin_forward, prepare = (manager.residency.takes_mapped_path, manager.begin_forward,
                                                 manager.slots.prepare)
    paths, set_inside, inside = [], [], [False]

    def every_third_on_the_round_trip(info):
        mapped = takes_mapped_path(info) and len(paths) % 3 != 2
        paths.append(mapped)
        return mapped

    def prepare_device(mapped, armed=None):
        if inside[0]:
            set_inside[-1] += 1
        return prepare(mapped, armed)

    def checked_begin_forward(info):
        set_inside.append(0)
        inside[0] = True
        begin_forward(info)
        inside[0] = False
        _assert_slot_map_is_the_tables(manager, info)
        for pos, layer in enumerate(manager.layers):
            if manager.mapped_forward:
                armed = [slot for slot, _ in manager.residency.armed[layer]]
                assert manager.slots.capture_table[pos].tolist() == armed + [-1] * (2 - len(armed))

    manager.residency.takes_mapped_path = every_third_on_the_round_trip
    manager.slots.prepare = prepare_device
    manager.begin_forward = checked_begin_forward
    assert _generate(llm, gen_length=8) == full_block
    after_mapped = [i for i in range(1, len(paths)) if paths[i] and paths[i - 1]]
    others = [i for i in range(len(paths)) if i not in after_mapped]
    assert after_mapped and all(set_inside[i] == 0 for i in after_mapped)
    assert others and all(set_inside[i] == 1 for i in others)


def test_a_trace_replays_the_mapped_decisions_exactly(kernels):
    """`oled trace` records a mapped run's header (mapped_rows), and a replay through the same policy and budget
    makes the live run's decisions: every layer record's counters equal, mapped pairs and bytes included; replayed
    without mapped misses, the same routing gives other decisions."""
    from oled.decoding.params import DecodeParams
    from oled.runtime.stats import TIMINGS
    from oled.trace import record_trace, replay

    for policy, capture in (("lru", 0), ("oled", 2)):
        llm = _llm(policy, "0.4", capture_slots=capture)
        prompt = llm.tokenizer.encode(PROMPT)
        trace, _ = record_trace(llm.engine, [("p", prompt)], DecodeParams(gen_length=16, block_length=8))
        assert trace.header["live"]["mapped_rows"] == 16 and trace.header["live"]["capture_slots"] == capture
        live = [{k: v for k, v in r.items() if k not in TIMINGS} for r in llm.engine.manager.stats.to_rows()]
        replayed = replay(trace, policy, trace.header["live"]["expert_budget"])
        rows = [{k: v for k, v in r.items() if k not in TIMINGS} for r in replayed.stats.to_rows()]
        assert rows == live and sum(r["pairs_mapped"] for r in rows) > 0
        assert (sum(r["experts_captured"] for r in rows) > 0) == bool(capture)
        plain = replay(trace, policy, trace.header["live"]["expert_budget"], mapped_rows=0).stats.to_rows()
        assert sum(r["pairs_mapped"] for r in plain) == 0


def test_the_traffic_replay_of_the_three_miss_paths():
    """benchmarks/mapped_traffic.py on the bundled model's trace: the host round trip reads nothing mapped, the mapped
    path computes nothing on the CPU and adds the mapped reads to its copies, the hybrid replays each block's
    first forward on the host round trip (fewer mapped bytes than the mapped path), and capture copies less."""
    from pathlib import Path

    from oled.trace import Trace

    root = Path(__file__).parents[1]
    traffic = benchmark_script("mapped_traffic")
    trace = Trace.load(root / "tests/data/tiny-code.trace")
    rows = {path: traffic.run(trace, "lru", "0.5", path, gbps=50.0) for path in traffic.PATHS}
    assert rows["host"]["mapped_gb"] == 0 and rows["host"]["copied_gb"] > 0
    assert rows["mapped"]["mapped_gb"] > 0 and rows["mapped"]["cpu_pairs"] == 0
    assert 0 < rows["hybrid"]["mapped_gb"] < rows["mapped"]["mapped_gb"]
    rows["capture"] = traffic.run(trace, "lru", "0.5", "capture", gbps=50.0, capture_slots=2)
    assert rows["capture"]["captured"] > 0 and rows["capture"]["capture_slots"] == 2
    assert rows["capture"]["copied_gb"] < rows["mapped"]["copied_gb"]     # captured misses are not copied
    for r in rows.values():
        assert r["pcie_gb"] == pytest.approx(r["copied_gb"] + r["mapped_gb"])
        assert r["pcie_ms"] == pytest.approx(r["pcie_gb"] / 50.0 * 1e3)
    # --expert-mib: the same decisions, bytes at another expert size
    size = trace.header["model"]["expert_bytes"]
    tripled = traffic.run(trace, "lru", "0.5", "capture", gbps=50.0, capture_slots=2, expert_bytes=3 * size)
    for key in ("mapped_gb", "copied_gb", "pcie_ms"):
        assert tripled[key] == pytest.approx(3 * rows["capture"][key])
    assert tripled["captured"] == rows["capture"]["captured"]
    # --requests 1: the first request's replay alone (fewer iterations, other bytes per iteration)
    first = traffic.run(trace.first_requests(1), "lru", "0.5", "mapped", gbps=50.0)
    assert first["mapped_gb"] > 0 and first != rows["mapped"]
    # policy options as oled bench writes them: oled-retain:decay=0.9 keeps other experts than oled-retain
    plain, decayed = (traffic.run(trace, p, "0.5", "capture", gbps=50.0, capture_slots=2)
                      for p in ("oled-retain", "oled-retain:decay=0.9"))
    assert decayed["policy"] == "oled-retain:decay=0.9" and decayed["pcie_gb"] != plain["pcie_gb"]
    with pytest.raises(ValueError, match="no option 'tau'"):
        traffic.run(trace, "oled-retain:tau=2", "0.5", "capture", gbps=50.0, capture_slots=2)


def test_a_mapped_read_waits_until_every_routing_value_has_landed():
    """The host learns that a mapped forward's routing landed from the buffer itself (no event a layer):
    _await_routing returns once no value is MAPPED_UNSET, or once the forward's end event is done, after which a value
    still unset is the value itself (a NaN weight of that pattern), so the wait is bounded either way."""
    from types import SimpleNamespace

    from oled.runtime.mapped import MAPPED_UNSET, MappedPath

    class ForwardEnd:
        """Stand-in for the forward's end event: the kernel's stores land at the `land`-th query, the forward is
        over from the `done`-th."""
        def __init__(self, buf, land, done):
            self.buf, self.land, self.done, self.queries = buf, land, done, 0

        def query(self):
            self.queries += 1
            if self.queries == self.land:
                self.buf[:] = np.arange(self.buf.size, dtype=np.int32).reshape(self.buf.shape)
            return self.queries >= self.done

    buf = np.full((2, 6), MAPPED_UNSET, dtype=np.int32)
    end = ForwardEnd(buf, land=3, done=10)
    MappedPath.await_routing(SimpleNamespace(forward_end=end), buf)
    assert end.queries == 3 and (buf != MAPPED_UNSET).all()
    buf[:] = MAPPED_UNSET                                   # a value that never changes: the forward's end ends it
    end = ForwardEnd(buf, land=0, done=4)
    MappedPath.await_routing(SimpleNamespace(forward_end=end), buf)
    assert end.queries == 4 and (buf == MAPPED_UNSET).all()



def test_the_replay_hook_and_the_prefetch_coverage_on_the_bundled_trace():
    """ReplayManager.replay(before_mapped) is called once per layer decided on the mapped path, with that run's
    routing and the residency not yet changed, and leaves the statistics as they are; oled/trace/prefetch_coverage.py
    (`oled trace --report TRACE --coverage`) counts from it the misses the recorded prediction names."""
    from pathlib import Path

    from oled.trace import Trace
    from oled.trace.replay import replay_manager

    root = Path(__file__).parents[1]
    trace = Trace.load(root / "tests/data/tiny-code.trace")
    mgr = replay_manager(trace, "lru", "0.5", mapped_rows=16, capture_slots=2)
    seen = []

    def hook(run, layer, ids):
        assert int(trace.run_layer[run]) == layer and np.array_equal(trace.run_ids(run), ids)
        seen.append((run, layer, sorted(mgr.cache.resident(layer))))

    rows = mgr.replay(hook).to_rows()
    plain = replay_manager(trace, "lru", "0.5", mapped_rows=16, capture_slots=2)
    assert rows == plain.replay().to_rows()
    mapped_layers = [r for r in rows if r["kind"] == "iteration"]
    assert len(seen) == len(mapped_layers) > 0
    # the residency the hook saw is the one before the layer's decision: its misses are the mapped ones
    misses = sum(len(set(trace.run_ids(run).reshape(-1).tolist()) - set(resident)) for run, _, resident in seen)
    assert misses == sum(r["experts_mapped"] for r in rows) > 0

    from oled.trace.prefetch_coverage import coverage

    row = coverage(trace, "lru", "0.5", None, 2)
    assert 0 < row["misses"] <= misses and 0 <= row["named"] <= row["misses"]
    assert row["named_not_needed"] <= row["named_not_resident"]


def test_the_iteration_ahead_coverage_on_the_bundled_trace():
    """oled/trace/ahead_coverage.py (`oled trace --report TRACE --ahead`): its misses are the replay's mapped experts; a longer look back names at least
    as many of them and fetches at least as much; `both` is the union of the widest window and the block prior; the
    bytes are the counts at the given expert size."""
    from pathlib import Path

    from oled.trace import Trace
    from oled.trace.replay import replay_manager

    root = Path(__file__).parents[1]
    trace = Trace.load(root / "tests/data/tiny-code.trace")
    from oled.trace import ahead_coverage as ahead
    rows = {r["prediction"]: r for r in ahead.coverage(trace, "lru", "0.5", 2, [1, 3], expert_bytes=10**9)}
    assert list(rows) == ["recent:1", "recent:3", "block", "both"]
    replayed = replay_manager(trace, "lru", "0.5", mapped_rows=ahead.mapped_rows(True), capture_slots=2)
    mapped = sum(r["experts_mapped"] for r in replayed.replay().to_rows())
    one, three, block, both = (rows[k] for k in ("recent:1", "recent:3", "block", "both"))
    assert one["misses_per_iteration"] * one["iterations"] == pytest.approx(mapped) and mapped > 0
    assert one["miss_gb_per_iteration"] == pytest.approx(one["misses_per_iteration"])      # 1 GB experts
    assert 0 < one["named_fraction"] <= three["named_fraction"] <= both["named_fraction"] <= 1
    assert one["fetched_per_iteration"] <= three["fetched_per_iteration"] <= both["fetched_per_iteration"]
    assert both["fetched_per_iteration"] <= three["fetched_per_iteration"] + block["fetched_per_iteration"]
    assert all(0 <= r["wasted_fraction"] <= 1 for r in rows.values())


def test_the_token_prior_and_the_rows_behind_the_misses():
    """oled/trace/ahead_coverage.py on a trace that carries the iterations' tokens: each row's input token is the
    prompt's or the request's output token once committed (where the output reaches), else the mask id; the token prior's union with recent
    names at least what either names and fetches at most both; every miss is used by some kind of row."""
    import oled
    from oled.decoding.params import DecodeParams
    from oled.trace import record_trace

    llm = oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="full")
    prompt = llm.tokenizer.encode(PROMPT)
    trace, _ = record_trace(llm.engine, [("p", prompt)], DecodeParams(gen_length=16, block_length=8))
    from oled.trace import ahead_coverage as ahead
    mask = int(trace.header["model"]["mask_token_id"])
    output = trace.output_ids(0)
    tokens = ahead.row_tokens(trace)
    assert len(tokens) == len(trace.fwd_kind)
    committed = 0
    for f, rows in enumerate(tokens):
        for p, tok in enumerate(rows.tolist(), int(trace.fwd_start[f])):
            if p < len(prompt):
                assert tok == prompt[p]
            elif tok != mask and p - len(prompt) < len(output):    # (a last block may run past the output)
                assert tok == output[p - len(prompt)]
                committed += 1
    assert committed > 0 and any((rows == mask).any() for rows in tokens)
    rows = {r["prediction"]: r for r in ahead.coverage(trace, "lru", "0.3", 2, [1, 2], expert_bytes=10**9)}
    assert list(rows) == ["recent:1", "recent:2", "block", "both", "token", "token+recent"]
    token, recent, union = rows["token"], rows["recent:2"], rows["token+recent"]
    assert token["misses_per_iteration"] > 0
    assert max(token["named_fraction"], recent["named_fraction"]) <= union["named_fraction"] <= 1
    assert union["fetched_per_iteration"] <= token["fetched_per_iteration"] + recent["fetched_per_iteration"] + 1e-9
    used = [token[f"misses_used_by_{k}_rows"] for k in ("masked", "new_token", "unchanged")]
    assert all(0 <= u <= 1 for u in used) and sum(used) >= 1 - 1e-9


def test_the_miss_bursts_on_the_bundled_trace(capsys):
    """oled/trace/miss_bursts.py (`oled trace --report TRACE --bursts`): every denoising iteration is in one step group, the groups' bytes are the replay's
    mapped bytes and their shares add up to one, step 0 is each block's first iteration, and the heaviest tenth of
    the iterations holds at least its share."""
    from pathlib import Path

    from oled.trace import Trace
    from oled.trace.replay import replay_manager

    root = Path(__file__).parents[1]
    trace = Trace.load(root / "tests/data/tiny-code.trace")
    from oled.trace import miss_bursts as script
    row = script.bursts(trace, "lru", "0.5", 2, expert_bytes=10**9, last_step=3)
    groups = row["by_step"]
    assert [g["step"] for g in groups] == [0, 1, 2, "3+"][: len(groups)] and len(groups) >= 2
    assert sum(g["iterations"] for g in groups) == row["iterations"] > 0
    assert sum(g["share"] for g in groups) == pytest.approx(1.0)
    replayed = replay_manager(trace, "lru", "0.5", mapped_rows=script.mapped_rows(True), capture_slots=2)
    records = [r for r in replayed.replay().records if r.kind == "iteration"]
    blob_reads = sum(r.bytes_mapped for r in records) / trace.header["model"]["expert_bytes"]
    blocks = {(int(trace.fwd_request[f]), trace.forward_info(f).block_start) for f in range(len(trace.fwd_kind))
              if trace.forward_info(f).kind == "iteration"}
    assert groups[0]["iterations"] == len(blocks)
    total = sum(g["mapped_gb_mean"] * g["iterations"] for g in groups)      # 1 GB experts: blobs read
    assert total == pytest.approx(row["mapped_gb_per_iteration"] * row["iterations"])
    assert total == pytest.approx(blob_reads) and total >= sum(r.experts_mapped for r in records) > 0
    assert 0.1 <= row["heaviest_tenth_share"] <= 1.0
    from oled.cli import main

    assert main(["trace", "--report", str(root / "tests/data/tiny-code.trace"), "--bursts", "--budgets", "0.5",
                 "--policies", "lru", "--capture-slots", "2", "--burst-steps", "3", "--expert-mib",
                 "953.67431640625"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(printed) == 1 and printed[0]["by_step"] == pytest.approx(groups)


def test_the_cooperative_mapped_estimate_on_the_bundled_trace():
    """benchmarks/coop_mapped_estimate.py: the planner's best split never costs more than reading every miss; with a
    CPU as fast as a read it sends misses to the CPU and saves time; with a CPU a thousand times slower it sends none
    and saves nothing; the read rate given replaces the measured load time."""
    from pathlib import Path

    from oled.trace import Trace

    from .costs import balanced_costs

    root = Path(__file__).parents[1]
    trace = Trace.load(root / "tests/data/tiny-code.trace")
    est = benchmark_script("coop_mapped_estimate")
    size = trace.header["model"]["expert_bytes"]
    costs = est.mapped_read_costs(balanced_costs(size), gbps=size / 1e-4 / 1e9, expert_bytes=size)
    assert costs.load_seconds(1) == pytest.approx(1e-4)
    even = est.estimate(trace, "lru", "0.5", costs, capture_slots=2)
    assert even["layers_with_misses_per_iteration"] > 0 and even["iterations"] > 0
    assert 0 < even["split_ms_per_iteration"] < even["mapped_ms_per_iteration"]
    assert even["saved_ms_per_iteration"] == pytest.approx(even["mapped_ms_per_iteration"] -
                                                           even["split_ms_per_iteration"])
    assert even["cpu_experts_per_iteration"] > 0 and even["cpu_pairs_per_iteration"] >= even["cpu_experts_per_iteration"]
    slow = est.mapped_read_costs(balanced_costs(size, seconds=1e-1), gbps=size / 1e-4 / 1e9, expert_bytes=size)
    none = est.estimate(trace, "lru", "0.5", slow, capture_slots=2)
    assert none["cpu_experts_per_iteration"] == 0 and none["saved_ms_per_iteration"] == pytest.approx(0)
    assert none["mapped_ms_per_iteration"] == pytest.approx(even["mapped_ms_per_iteration"])


def test_forced_misses_bound_every_policys_loads_on_the_bundled_trace():
    """oled/trace/forced_misses.py (`oled trace --report TRACE --forced`): a layer routing to U distinct experts with S slots misses at least U - S, so the
    forced misses, counted here by hand over the trace's iterations, are what the script reports, none with every
    expert in a slot, and no more than belady's misses (or any policy's) in the same replay."""
    from pathlib import Path

    from oled.trace import Trace
    from oled.trace.format import KINDS
    from oled.trace.replay import replay_manager

    root = Path(__file__).parents[1]
    trace = Trace.load(root / "tests/data/tiny-code.trace")
    from oled.trace import forced_misses as script
    experts = trace.header["model"]["num_experts"]
    assert script.forced_misses(trace, "1.0", 1)["forced_misses_per_iteration"] == 0
    row = script.forced_misses(trace, "0.3", 1)
    slots = row["slots_per_layer"]
    assert 0 < slots < experts
    iterations = {int(f) for f in np.nonzero(trace.fwd_kind == KINDS.index("iteration"))[0]}
    forced = sum(max(0, len(np.unique(trace.run_ids(run))) - slots) for run in range(len(trace.run_layer))
                 if int(trace.run_forward[run]) in iterations)
    assert row["iterations"] == len(iterations) and forced > 0
    assert row["forced_misses_per_iteration"] == pytest.approx(forced / len(iterations))
    assert row["forced_gb_per_iteration"] == pytest.approx(forced / len(iterations) / 1e9)
    lru = replay_manager(trace, "lru", "0.3")
    lru.replay()
    assert forced / len(iterations) <= row["belady_misses_per_iteration"] <= lru.stats.summary()["misses_per_iteration"]


@pytest.mark.parametrize("policy,budget,mapped", [("full", "1.0", False), ("lru", "0.5", True),
                                                  ("lru", "0.5", False), ("oled-coop", "0.3", False)],
                         ids=["all-resident", "mapped", "host-round-trip", "cpu-misses"])
def test_the_shared_expert_in_the_moe_kernels_on_every_path(kernels, policy, budget, mapped):
    """EngineConfig.shared_in_moe: each layer's shared expert is computed by the fused MoE kernels as one more expert
    of every token (its weights one blob, the SwiGLU's three weights views of it), so its own module never runs, on
    the all-resident, mapped, host round trip and CPU-miss paths alike; the tokens are those of the shared expert
    computed by its own GEMMs (fp32)."""
    from oled.models.layers import SwiGLU

    tokens, calls = {}, []
    original = SwiGLU.forward

    def counted(self, x):
        calls.append(self)
        return original(self, x)

    for in_moe in (True, False):
        llm = _llm(policy, budget, mapped=mapped, shared_in_moe=in_moe)
        manager = llm.engine.manager
        shared = {b.shared for b in llm.engine.model.moe_blocks()}
        assert None not in shared and manager.shared_in_moe == in_moe
        assert manager.mapped == mapped and manager.all_resident == (policy == "full")
        if in_moe:                       # the blob holds the weights, which are views of it
            block = llm.engine.model.moe_blocks()[0]
            blob = manager.compute.shared_blobs[block.layer_idx]
            assert blob is block.shared.blob and block.shared.down_proj.weight.data_ptr() == (
                blob.data_ptr() + 2 * block.shared.gate_proj.weight.numel() * blob.element_size())
        calls.clear()
        SwiGLU.forward = counted
        try:
            tokens[in_moe] = _generate(llm, gen_length=8)
        finally:
            SwiGLU.forward = original
        assert bool(shared & set(calls)) != in_moe
    assert tokens[True] == tokens[False]
