"""The OLED policy: reuse prediction, retention, reuse-aware cooperative misses, its variants, and the `belady` bound.

- the predictor scores the experts of still-masked, low-confidence positions above those of positions committed now;
- retention never evicts an expert the current layer needs;
- `belady` needs the fewest loads any retention can (brute force over tiny sequences);
- `oled`, `oled-retain`, `oled-coop` give the tokens of `full` (fp32) on the tiny presets and the bundled model;
- every baseline's replayed statistics are those the previous policy interface gave (golden digests);
- the reuse calibration is measured from traces, and the shipped one loads.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import random
from pathlib import Path

import numpy as np
import pytest

import oled
from oled.policies import ForwardInfo, IterationEvent, LayerEvent, PolicyContext, make_policy
from oled.policies.reuse import CONFIDENCE_EDGES, ReuseCalibration, ReusePredictor, calibrate
from oled.runtime.budget import ExpertBudget
from oled.runtime.expert_cache import ExpertCache
from oled.runtime.planner import split_misses
from oled.runtime.residency import Residency
from oled.runtime.stats import TIMINGS, RunStats
from oled.trace import Trace, replay

from .costs import balanced_costs

DATA = Path(__file__).parent / "data"
TINY_TRACE = DATA / "tiny-code.trace"       # the bundled model, workload code, 3 prompts, 64 tokens, block 32
D, M, C = IterationEvent.DECODED, IterationEvent.MASKED, IterationEvent.COMMITTED


@pytest.fixture(scope="module")
def tiny_trace():
    return Trace.load(TINY_TRACE)


def _calibration(**kw) -> ReuseCalibration:
    base = dict(decoded=0.95, committed=0.3, masked=list(np.linspace(0.9, 0.4, len(CONFIDENCE_EDGES) - 1)),
                masked_first=0.8, mask_prior=0.6)
    return ReuseCalibration(**dict(base, **kw))


# ------------------------------------------------------------------------------------------------------- predictor
def test_scores_rank_masked_low_confidence_above_committed_now():
    """Block of 4 positions, one expert each: 0 decoded earlier, 1 masked at low confidence, 2 masked at high
    confidence, 3 committed now. Next-iteration reuse: decoded > masked-low > masked-high > committed."""
    pred = ReusePredictor([1], num_experts=8, calibration=_calibration())
    info = ForwardInfo(kind="iteration", start=32, tokens=4, block_start=32, block_length=4)
    pred.on_forward(info)
    pred.observe(1, np.array([[0], [1], [2], [3]]), np.ones((4, 1), np.float32))
    event = IterationEvent(block=8, step=1, iteration=5, state=np.array([D, M, M, C], np.int8),
                           confidence=np.array([-np.inf, 0.15, 0.85, 0.97]), block_done=False)
    pred.on_iteration(event)
    s = pred.layer_scores(1)
    assert s[0] > s[1] > s[2] > s[3] > 0 and s[4] == 0
    assert s[3] == pytest.approx(0.3) and s[1] == pytest.approx(_calibration().masked_p(np.array([0.15]))[0])


def test_masked_p_bins_every_confidence_including_non_finite_ones():
    """A confidence in [edge i, edge i+1) takes bin i; 1.0 and above (+inf) the last bin; below 0 (-inf: a position
    not masked) and NaN the first, each against a bin search written out over the edges."""
    cal = _calibration()
    conf = np.array([0.0, 0.05, 0.1, 0.15, 0.899, 0.9, 0.95, 0.999, 1.0, 7.0, np.inf, -0.5, -np.inf, np.nan])

    def bin_of(c):
        if np.isnan(c) or c < CONFIDENCE_EDGES[0]:
            return 0
        return min(max(i for i, edge in enumerate(CONFIDENCE_EDGES) if c >= edge), len(cal.masked) - 1)
    want = [cal.masked[bin_of(c)] for c in conf]
    assert cal.masked_p(conf).tolist() == want
    assert want[:3] == [cal.masked[0], cal.masked[0], cal.masked[1]]
    assert want[-4:] == [cal.masked[-1]] + [cal.masked[0]] * 3


def test_rows_outside_the_block_and_block_boundaries():
    """A block's first forward also runs the previous block's final tokens: those rows are not run again and score
    nothing. At a block's end the first-iteration mask routing of the block is carried into the scores."""
    cal = _calibration(mask_prior=0.5)
    pred = ReusePredictor([1], num_experts=8, calibration=cal)
    # first iteration of block 1 (positions 4..7), with block 0's final rows (positions 0..3) in front
    pred.on_forward(ForwardInfo(kind="iteration", start=0, tokens=8, block_start=4, block_length=4))
    pred.observe(1, np.array([[7]] * 4 + [[5], [5], [6], [6]]), np.ones((8, 1), np.float32))
    state = np.array([M, M, C, C], np.int8)
    pred.on_iteration(IterationEvent(block=1, step=0, iteration=0, state=state,
                                     confidence=np.array([0.2, 0.2, 0.99, 0.99]), block_done=False))
    s = pred.layer_scores(1).copy()
    assert s[7] == 0                                     # the previous block's rows: never run again
    assert s[5] > s[6] > 0
    # the block's last iteration: the mask routing of its first iteration (experts 5, 6) predicts the next block
    pred.on_forward(ForwardInfo(kind="iteration", start=4, tokens=4, block_start=4, block_length=4))
    pred.observe(1, np.array([[1], [1], [2], [2]]), np.ones((4, 1), np.float32))
    pred.on_iteration(IterationEvent(block=1, step=1, iteration=1, state=np.array([C, C, D, D], np.int8),
                                     confidence=np.full(4, -np.inf), block_done=True))
    s = pred.layer_scores(1)
    assert s[5] == pytest.approx(0.5 * 2) and s[6] == pytest.approx(0.5 * 2)     # decay 0: only the prior remains
    assert s[1] == pytest.approx(2 * cal.committed) and s[2] == pytest.approx(2 * cal.decoded)


def test_predictor_weighting_and_decay():
    cal = _calibration()
    pred = ReusePredictor([1, 2], num_experts=4, calibration=cal, decay=0.5, weighting="weight")
    info = ForwardInfo(kind="iteration", start=0, tokens=2, block_start=0, block_length=2)
    ev = IterationEvent(block=0, step=1, iteration=0, state=np.array([D, D], np.int8),
                        confidence=np.full(2, -np.inf), block_done=False)
    for _ in range(2):
        pred.on_forward(info)
        pred.observe(1, np.array([[0, 1], [0, 2]]), np.array([[0.7, 0.3], [0.6, 0.4]], np.float32))
        pred.observe(2, np.array([[3, 1], [3, 1]]), np.array([[0.5, 0.5], [0.5, 0.5]], np.float32))
        pred.on_iteration(ev)
    # two iterations, decay 0.5: score = (1 + 0.5) * p_decoded * summed weights
    assert pred.layer_scores(1)[0] == pytest.approx(1.5 * cal.decoded * 1.3, rel=1e-6)
    assert pred.layer_scores(2)[1] == pytest.approx(1.5 * cal.decoded * 1.0, rel=1e-6)
    assert pred.layer_scores(2)[0] == 0
    with pytest.raises(ValueError, match="decay"):
        ReusePredictor([1], 4, cal, decay=1.0)
    with pytest.raises(ValueError, match="weighting"):
        make_policy("oled", weighting="tokens")


# ------------------------------------------------------------------------------------------------------- retention
def _event(layer, demand, resident, rows=None):
    ids = np.array([[e] for e, n in demand.items() for _ in range(n)], dtype=np.int64).reshape(-1, 1)
    info = ForwardInfo(kind="iteration", start=0, tokens=len(ids), block_start=0, block_length=max(len(ids), 1))
    return LayerEvent(layer=layer, forward=info, ids=ids, weights=np.ones(ids.shape, np.float32),
                      demand=dict(demand), resident=set(resident))


@pytest.mark.parametrize("name", ["oled", "oled-retain", "oled-coop"])
def test_retention_never_evicts_an_expert_the_layer_needs(tiny_trace, name, monkeypatch):
    """Replayed through the tiny trace at budgets where a layer's experts fit its slots: every expert the layer needs
    that was resident before it ran is resident after it; reuse retention also ranks needed experts last."""
    costs = balanced_costs(tiny_trace.header["model"]["expert_bytes"])
    begin, end = Residency.begin_layer, Residency.end_layer
    pending, checked = [], []

    def begin_layer(self, layer, ids, weights, predicted=None):
        step = begin(self, layer, ids, weights, predicted)
        needed = set(step.demand)
        if len(needed) <= self.cache.capacity:
            pending.append(needed & set(self.cache.resident(layer)))
        if self.policy.retention == "reuse":
            order = list(step.decision.evict)
            unneeded = [e for e in order if e not in needed]
            assert order[: len(unneeded)] == unneeded, "needed experts are ranked last"
        return step

    def end_layer(self, step):
        if pending:
            kept = pending.pop()
            assert kept <= set(self.cache.resident(step.layer)), (name, step.layer)
            checked.append(len(kept))
        return end(self, step)

    monkeypatch.setattr(Residency, "begin_layer", begin_layer)
    monkeypatch.setattr(Residency, "end_layer", end_layer)
    for budget in ("0.5", "0.75"):
        replay(tiny_trace, name, budget, costs=costs)
    assert len(checked) > 100 and sum(checked) > 1000


def test_retention_evicts_the_lowest_predicted_reuse():
    p = make_policy("oled-retain")
    p.setup(PolicyContext(layers=[1], num_experts=8, capacity=3, top_k=1, expert_bytes=1))
    p.on_forward(ForwardInfo(kind="iteration", start=0, tokens=3, block_start=0, block_length=3))
    p.decide(_event(1, {0: 1, 1: 1, 2: 1}, set()))
    # position 0 (expert 0) decoded, 1 (expert 1) committed now, 2 (expert 2) still masked at low confidence
    p.on_iteration(IterationEvent(block=0, step=1, iteration=0, state=np.array([D, C, M], np.int8),
                                  confidence=np.array([-np.inf, 0.99, 0.1]), block_done=False))
    p.on_forward(ForwardInfo(kind="iteration", start=0, tokens=1, block_start=0, block_length=3))
    d = p.decide(_event(1, {5: 1}, {0, 1, 2}))
    assert d.load == [5] and list(d.evict)[0] == 1        # the expert of the position committed now goes first


def test_the_eviction_rank_is_the_plain_sort_by_need_score_last_use_and_id():
    """oled's vectorised rank (NumPy arrays of scores and last uses) against sorted() over Python tuples: experts the
    layer needs last, then the lowest predicted reuse, the least recently used, the lowest id first."""
    rng = random.Random(5)
    for _ in range(40):
        p = make_policy("oled-retain")
        p.setup(PolicyContext(layers=[1], num_experts=24, capacity=8, top_k=2, expert_bytes=1))
        for _ in range(rng.randint(0, 6)):                 # a history of uses, so last uses differ and tie
            p.touch(1)
            p.pending[1] = {e: 1 for e in rng.sample(range(24), rng.randint(1, 5))}
        p.touch(1)
        p.predictor.score[0] = [rng.choice([0.0, 0.0, 0.5, 1.25, 2.0]) for _ in range(24)]
        resident = set(rng.sample(range(24), 8))
        extra = rng.sample(sorted(set(range(24)) - resident), rng.randint(0, 3))
        needed = {e: 1 for e in rng.sample(sorted(resident), rng.randint(0, 4)) + extra}
        last, score = p.last_use[1], p.predictor.layer_scores(1)
        want = sorted(resident | set(extra), key=lambda e: (e in needed, score[e], last[e], e))
        assert list(p.eviction_order(1, resident, extra, needed=needed)) == want


def test_row_probabilities_are_made_once_per_forward_and_follow_each_iteration():
    """log_keep, asked by every layer of a forward, is log(1 - P(reuse)) of its rows, and is made again after an
    iteration's states arrive and at the next forward."""
    pred = ReusePredictor([1, 2], 8, _calibration())
    info = ForwardInfo(kind="iteration", start=0, tokens=3, block_start=0, block_length=3)
    pred.on_forward(info)

    def expected(n):
        rows, positions = pred.row_positions()
        return np.log1p(-np.minimum(pred.current_p(rows, positions, n), 1.0 - 1e-12))
    first = pred.log_keep(3)
    np.testing.assert_array_equal(first, expected(3))
    assert pred.log_keep(3) is first                                  # the forward's other layers reuse it
    pred.observe(1, np.array([[0], [1], [2]]), np.ones((3, 1), np.float32))
    pred.on_iteration(IterationEvent(block=0, step=1, iteration=0, state=np.array([D, C, M], np.int8),
                                     confidence=np.array([-np.inf, 0.99, 0.1]), block_done=False))
    pred.on_forward(info)
    second = pred.log_keep(3)
    np.testing.assert_array_equal(second, expected(3))
    assert not np.array_equal(second, first)       # the states changed the probabilities


# ------------------------------------------------------------------------------------------------- reuse credit
def test_reuse_credit_buys_a_load_the_makespan_alone_would_not():
    """Loads twice as costly as CPU jobs: without a credit every miss goes to the CPU (lru, cooperative). With
    `oled`, a miss routed by a decoded position (its routing repeats for many iterations) is loaded; one routed by a
    masked position about to be committed (confidence 0.99: low reuse in this calibration) stays on the CPU."""
    expert_bytes = 6 * 2**20
    costs = balanced_costs(expert_bytes, seconds=50e-6)
    costs.h2d_gbps /= 2.0
    ctx = PolicyContext(layers=[1], num_experts=16, capacity=4, top_k=1, expert_bytes=expert_bytes, costs=costs,
                        planner=split_misses)
    info = ForwardInfo(kind="iteration", start=0, tokens=2, block_start=0, block_length=2)
    decided = {}
    for name in ("lru", "oled"):
        p = make_policy("lru", misses="cooperative") if name == "lru" else make_policy(name, calibration=_calibration())
        p.setup(ctx)
        p.on_forward(info)
        p.decide(_event(1, {0: 1, 1: 1}, {0, 1, 2, 3}))
        p.on_iteration(IterationEvent(block=0, step=1, iteration=0, state=np.array([D, M], np.int8),
                                      confidence=np.array([-np.inf, 0.99]), block_done=False))
        p.on_forward(info)
        decided[name] = p.decide(_event(1, {8: 1, 9: 1}, {0, 1, 2, 3}))
    assert decided["lru"].load == [] and sorted(decided["lru"].cpu) == [8, 9]
    assert decided["oled"].load == [8] and decided["oled"].cpu == [9]
    p = make_policy("oled", calibration=_calibration(), horizon=1)     # valued over one iteration: not worth it
    p.setup(ctx)
    assert p.future_uses(0.95) == 1 and p.future_uses(0.5) == 1 and make_policy("oled").future_uses(0.5) == 1.0
    assert make_policy("oled").future_uses(0.99) == 8 and make_policy("oled").future_uses(1.0) == 8
    with pytest.raises(ValueError, match="horizon"):
        make_policy("oled", horizon=0)


def test_waves_let_misses_beyond_the_free_slots_load():
    """A layer that needs more experts than it has slots: 4 slots, all holding experts it needs, 3 misses. In one
    wave the planner has no slot to load into, so every miss goes to the CPU whatever it costs; with waves=1 misses
    may load into the slots of experts already computed, and do when loading is the cheaper side."""
    expert_bytes = 6 * 2**20
    costs = balanced_costs(expert_bytes, seconds=50e-6)
    costs.cpu_seconds = {1: 1e-3, 32: 1e-3}              # the CPU 20 x slower than a load
    ctx = PolicyContext(layers=[1], num_experts=16, capacity=4, top_k=1, expert_bytes=expert_bytes, costs=costs,
                        planner=split_misses)
    demand = {0: 1, 1: 1, 2: 1, 3: 1, 8: 1, 9: 1, 10: 1}
    decided = {}
    for waves in (0, 1):
        p = make_policy("oled", calibration=_calibration(), waves=waves)
        p.setup(ctx)
        p.on_forward(ForwardInfo(kind="iteration", start=0, tokens=7, block_start=0, block_length=7))
        decided[waves] = p.decide(_event(1, demand, {0, 1, 2, 3}))
    assert decided[0].load == [] and sorted(decided[0].cpu) == [8, 9, 10]
    assert sorted(decided[1].load) == [8, 9, 10] and decided[1].cpu == []
    with pytest.raises(ValueError, match="waves must be 0"):
        make_policy("oled", waves=2)


# ------------------------------------------------------------------------------------------------------- belady
def _min_loads(sequence, capacity):
    """Brute force: the fewest loads any eviction choices give for a sequence of demand sets (each fits)."""
    states = {frozenset(): 0}
    for need in sequence:
        nxt = {}
        for cache, loads in states.items():
            missing = need - cache
            keep_room = capacity - len(missing)
            others = sorted(cache - need)
            for kept in itertools.combinations(others, min(len(others), max(keep_room - len(cache & need), 0))):
                new = frozenset(cache & need) | frozenset(kept) | missing
                if len(new) <= capacity:
                    nxt[new] = min(nxt.get(new, 1 << 30), loads + len(missing))
        states = nxt
    return min(states.values())


@pytest.mark.parametrize("seed", range(25))
def test_belady_misses_between_the_exact_bound_and_loading_every_miss(seed):
    """belady (with bypass, its hits kept as the runtime keeps them) misses no fewer than the exact fewest misses
    (oled/bounds.py, checked by brute force in test_bounds.py) and no more than the best schedule loading every
    miss (brute force)."""
    from oled.bounds import Demand, LayerRun, belady

    rng = random.Random(seed)
    capacity, n_experts = rng.randint(1, 3), rng.randint(3, 6)
    seq = [frozenset(rng.sample(range(n_experts), rng.randint(1, capacity))) for _ in range(rng.randint(3, 9))]
    budget = ExpertBudget(slots_per_layer=capacity, num_layers=1, expert_bytes=1, total_expert_bytes=n_experts)
    cache = ExpertCache([1], budget, 1, None, "meta", n_experts)
    policy = make_policy("belady")
    res = Residency(cache, policy, RunStats(), num_experts=n_experts, top_k=capacity, expert_bytes=1)
    policy.set_future({1: [set(s) for s in seq]})
    res.begin_forward(ForwardInfo(kind="iteration", start=0, tokens=capacity, block_start=0, block_length=capacity))
    misses = 0
    for need in seq:
        ids = np.array(sorted(need), dtype=np.int64).reshape(-1, 1)
        step = res.begin_layer(1, ids, np.ones(ids.shape, np.float32))
        misses += len(step.decision.load) + len(step.decision.cpu)
        for _ in res.waves(step):
            pass
        res.end_layer(step)
    # (the bound starts its pool filled free, the replay empty: it can only be lower still)
    demand = Demand([1], [LayerRun(1, True, np.array(sorted(s)), np.ones(len(s), np.int64), len(s)) for s in seq],
                    len(seq), 1)
    assert belady(demand, capacity).misses(demand) <= misses <= _min_loads(seq, capacity)


def test_belady_is_replay_only_and_bounds_the_loads(tiny_trace):
    with pytest.raises(ValueError, match="it runs in replays only"):       # refused before the model is built
        oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="belady", expert_budget="0.5")
    for budget in ("0.4", "0.25"):
        best = replay(tiny_trace, "belady", budget).stats.summary()["totals"]["loads"]
        for name in ("lru", "lfu", "oled-retain"):
            assert replay(tiny_trace, name, budget).stats.summary()["totals"]["loads"] >= best


# ------------------------------------------------------------------------------------------------------- lossless
PROMPT = "hello world, how are you today?"


@pytest.mark.parametrize("name", ["oled", "oled-retain", "oled-coop"])
def test_oled_variants_give_the_tokens_of_full_on_the_bundled_model(name):
    full = oled.LLM(device="cpu", dtype="float32", policy="full")
    want = full.generate("def fibonacci(n):", gen_length=48).token_ids
    llm = oled.LLM(device="cpu", dtype="float32", policy=name, expert_budget="0.25", cpu_threads=1)
    if llm.engine.policy.uses_cpu:
        llm.engine.costs = balanced_costs(llm.engine.store.expert_bytes)    # both sides used on any machine
        llm.engine.set_runtime(name, "0.25")
    assert llm.generate("def fibonacci(n):", gen_length=48).token_ids == want
    s = llm.stats()
    assert s["hit_rate_tokens"] < 1.0                     # the budget really misses
    if name != "oled-retain":
        assert s["cpu_pairs_per_iteration"] > 0 and s["totals"]["loads"] > 0


def test_oled_is_the_default_policy():
    from oled.config import EngineConfig
    assert EngineConfig().policy == "oled"
    assert oled.LLM(random_weights="tiny", device="cpu", dtype="float32").engine.policy.name == "oled"


# ------------------------------------------------------------------------------- baselines under the new interface
MAPPED_FIELDS = ("pairs_mapped", "experts_mapped", "bytes_mapped", "experts_captured")


def test_baselines_replay_exactly_as_before_the_interface_change():
    """Digests of every layer record of every forward, from the replays the previous interface (plan / victim /
    prefetch / on_access calls) gave at commit df8f5fc, on the bundled model's trace and an H200 trace of the
    LLaDA2.0-mini shapes."""
    golden = json.loads((DATA / "baseline_replay_golden.json").read_text())
    traces = {"tiny-code.trace": TINY_TRACE,
              "mini.trace": Path(__file__).parents[1] / "benchmarks/results/h200/mini.trace"}
    loaded = {}
    for key, want in golden.items():
        name, policy, options, budget = key.split("|")
        trace = loaded.setdefault(name, Trace.load(traces[name]))
        options = json.loads(options)
        if policy == "fiddler":
            options["popularity"] = trace.popularity()
        records = replay(trace, policy, budget, **options).stats.to_rows()
        # fields added since (the mapped path's, which a replay never takes) are 0 and left out of the digest
        assert all(r[k] == 0 for r in records for k in MAPPED_FIELDS)
        # and loads_used, added since too (a count of the same decisions' later hits)
        rows = [{k: v for k, v in r.items() if k not in TIMINGS and k not in MAPPED_FIELDS and k != "loads_used"}
                for r in records]
        digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
        assert digest == want["rows_sha256"], key
    assert len(golden) == 30


# ------------------------------------------------------------------------------------------------- calibration
def test_calibration_from_a_trace(tiny_trace, tmp_path):
    cal = calibrate([tiny_trace])
    assert 0 < cal.committed < cal.decoded <= 1 and 0 < cal.masked_first <= 1 and 0 < cal.mask_prior <= 1
    assert len(cal.masked) == len(CONFIDENCE_EDGES) - 1 and all(0 <= p <= 1 for p in cal.masked)
    assert cal.pairs["decoded"] > 1000 and sum(cal.pairs["masked"]) > 1000
    path = tmp_path / "cal.json"
    path.write_text(cal.to_json())
    assert ReuseCalibration.load(path) == cal
    shipped = ReuseCalibration.load()
    assert shipped.decoded == pytest.approx(cal.decoded) and shipped.committed == pytest.approx(cal.committed)
    with pytest.raises(ValueError, match="not found"):
        ReuseCalibration.load(tmp_path / "missing.json")
    bad = json.loads(cal.to_json())
    bad["masked"] = [0.5]
    with pytest.raises(ValueError, match="confidence bins"):
        ReuseCalibration.load(bad)


# ------------------------------------------------------------------------------------------- predictor report
def test_predictor_report_and_cli(tiny_trace, tmp_path, capsys):
    from oled.cli import main
    from oled.trace.predictor import GROUPS, POLICIES, format_predictor_report, predictor_report

    costs = balanced_costs(tiny_trace.header["model"]["expert_bytes"])
    rep = predictor_report(tiny_trace, ("0.4",), costs)
    r = rep["ranking"]
    assert r["pairs"] > 10_000 and 0.5 < r["auc"] <= 1.0 and set(r["groups"]) == set(GROUPS)
    assert r["groups"]["not routed"]["used_next"] < r["groups"]["any masked"]["used_next"]
    cells = {name: rep["retention"][f"{name}@0.4"] for name in POLICIES}
    assert all(0 < c["held_of_needed"] <= 1 and c["host_us_per_iteration"] > 0 for c in cells.values())
    assert cells["belady"]["held_of_needed"] >= cells["lru"]["held_of_needed"]     # the load-optimal retention
    assert "AUC" in format_predictor_report(rep)
    cost_file, cal_file = tmp_path / "costs.json", tmp_path / "cal.json"
    cost_file.write_text(costs.to_json())
    assert main(["trace", "--report", str(TINY_TRACE), "--predictor", "--budgets", "0.25", "--cost-model",
                 str(cost_file), "--calibrate-reuse", str(cal_file)]) == 0
    out = capsys.readouterr().out
    assert "Ranking next-iteration use" in out and "0.25: oled" in out
    assert ReuseCalibration.load(cal_file) == calibrate([tiny_trace])
