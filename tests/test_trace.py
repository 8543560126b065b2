"""oled trace: recording, the trace file, the locality report, and replay through policies on the CPU.

The key property: replaying a trace through a policy gives the same hit, load, eviction and CPU counts as the live
run on the same model (the replayer runs the manager's own decision code, oled.runtime.residency)."""
from __future__ import annotations

import numpy as np
import pytest

from oled.config import EngineConfig
from oled.decoding.params import DecodeParams
from oled.engine import Engine
from oled.policies.base import IterationEvent
from oled.runtime.cost_model import CostModel
from oled.runtime.stats import TIMINGS
from oled.trace import KINDS, Trace, format_locality, locality, record_trace, replay
from oled.trace.format import BEGIN, END, EVENT, REQUEST, RUN

from .costs import balanced_costs

PROMPTS = ["def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "Hello there, how are you today?"]
PARAMS = dict(gen_length=32, block_length=16)


@pytest.fixture(scope="module")
def engine():
    eng = Engine(EngineConfig(random_weights="tiny", expert_budget="0.5", policy="lru"))
    yield eng
    eng.manager.close()


def _prompts(engine):
    return [(f"p{i}", engine.tokenizer.encode(p)) for i, p in enumerate(PROMPTS)]


def _record(engine, policy, budget, tmp_path, predictions=True, **options):
    engine.set_runtime(policy, budget, **options)
    trace, results = record_trace(engine, _prompts(engine), DecodeParams(**PARAMS), predictions=predictions)
    live_rows = engine.manager.stats.to_rows()
    path = trace.save(tmp_path / f"{policy}-{budget}.trace")
    return Trace.load(path), results, live_rows


@pytest.fixture(scope="module")
def lru_trace(engine, tmp_path_factory):
    return _record(engine, "lru", "0.5", tmp_path_factory.mktemp("trace"))


def test_replay_through_lru_gives_the_live_hit_counts(lru_trace):
    trace, _, live_rows = lru_trace
    rep = replay(trace, "lru", "0.5")
    assert rep.stats.to_rows() == live_rows                       # every layer record of every forward
    live_hits = sum(r["pairs_hit"] for r in live_rows)
    assert 0 < live_hits < sum(r["pairs"] for r in live_rows)     # the budget really misses
    assert rep.stats.summary(kinds=KINDS)["totals"] == trace.header["live"]["totals"]


@pytest.mark.parametrize("policy,budget,options", [("lfu", "0.25", {}), ("prefetch", "0.25", {}),
                                                   ("lru", "0.125", {})])
def test_replay_matches_live_for_other_policies(engine, tmp_path, policy, budget, options):
    trace, _, live_rows = _record(engine, policy, budget, tmp_path, **options)
    assert replay(trace, policy, budget, **options).stats.to_rows() == live_rows


def test_replay_of_cpu_policy_matches_live(engine, tmp_path):
    pytest.importorskip("oled.policies.tide")
    trace, _, live_rows = _record(engine, "tide", "0.25", tmp_path, tau=2)
    rows = replay(trace, "tide", "0.25", tau=2).stats.to_rows()
    decisions = [{k: v for k, v in r.items() if k not in TIMINGS} for r in live_rows]
    assert rows == [dict(r, **dict.fromkeys(TIMINGS, 0.0)) for r in decisions]    # the replay has no timings
    assert sum(r["pairs_cpu"] for r in rows) > 0


@pytest.mark.parametrize("policy", ["oled", "oled-coop", "oled-retain", "oled:waves=1"])
def test_replay_of_oled_matches_live(engine, tmp_path, policy):
    """The OLED policy sees token layouts, routing weights and iteration states: from a trace it gets the very same
    events, so its replay makes the live run's decisions (cooperative ones on the recorded costs)."""
    engine.costs = balanced_costs(engine.store.expert_bytes)
    name, _, option = policy.partition(":")
    options = {option.split("=")[0]: int(option.split("=")[1])} if option else {}
    trace, _, live_rows = _record(engine, name, "0.25", tmp_path, **options)
    rows = replay(trace, name, "0.25", **options).stats.to_rows()
    assert rows == [dict(r, **dict.fromkeys(TIMINGS, 0.0)) for r in live_rows]
    assert sum(r["loads"] for r in rows) > 0
    assert (sum(r["pairs_cpu"] for r in rows) > 0) == (name != "oled-retain")


def test_replay_of_cooperative_misses_plans_on_the_recorded_costs(engine, tmp_path, lru_trace):
    """A trace records the cost model of its run; a cooperative replay plans on it (same decisions as live), or on
    the cost model it is given, and refuses to guess when there is none."""
    engine.costs = balanced_costs(engine.store.expert_bytes)
    trace, _, live_rows = _record(engine, "lru", "0.25", tmp_path, misses="cooperative")
    assert trace.header["costs"] == engine.costs.to_dict() and trace.header["live"]["misses"] == "cooperative"
    rows = replay(trace, "lru", "0.25", misses="cooperative").stats.to_rows()
    decisions = [{k: v for k, v in r.items() if k not in TIMINGS} for r in live_rows]
    assert rows == [dict(r, **dict.fromkeys(TIMINGS, 0.0)) for r in decisions]
    assert sum(r["pairs_cpu"] for r in rows) > 0 and sum(r["loads"] for r in rows) > 0
    slow_pcie = CostModel.from_dict(dict(engine.costs.to_dict(), h2d_gbps=engine.costs.h2d_gbps / 1000))
    rep = replay(trace, "lru", "0.25", slow_pcie, misses="cooperative")
    rows = rep.stats.to_rows()
    # loads too slow to pay: only the free slots are filled (once each), everything else runs on the CPU
    assert sum(r["loads"] for r in rows) == rep.cache.capacity * len(rep.cache.layers)
    assert sum(r["pairs_cpu"] for r in rows) > 0
    with pytest.raises(ValueError, match="cost model"):
        replay(lru_trace[0], "lru", "0.25", misses="cooperative")     # recorded by a GPU-only policy: no costs


def test_trace_content(lru_trace, engine):
    trace, results, _ = lru_trace
    ops = trace.ops
    assert (ops[:, 0] == REQUEST).sum() == len(PROMPTS)
    assert (ops[:, 0] == BEGIN).sum() == (ops[:, 0] == END).sum() == len(trace.fwd_kind)
    iters = int((trace.fwd_kind == KINDS.index("iteration")).sum())
    assert iters == sum(r.nfe for r in results) == (ops[:, 0] == EVENT).sum()
    layers = trace.layers
    assert (ops[:, 0] == RUN).sum() == len(trace.fwd_kind) * len(layers)
    k = engine.config.top_k
    for i in range(len(trace.run_layer)):
        f = trace.run_forward[i]
        ids = trace.run_ids(i)
        assert ids.shape == (trace.fwd_tokens[f], k)
        assert ((0 <= ids) & (ids < engine.config.num_experts)).all()
        w = trace.weights[trace.run_offset[i]: trace.run_offset[i + 1]]
        assert w.shape == ids.shape and np.isfinite(w).all()
        pred = trace.run_pred(i)                                   # next layer's predicted routing
        assert (pred is None) == (trace.run_layer[i] == layers[-1])
    for j in range(len(trace.ev_forward)):
        ev = trace.event(j)
        assert trace.fwd_kind[trace.ev_forward[j]] == KINDS.index("iteration")
        assert len(ev.state) == PARAMS["block_length"]
        not_masked = ev.state == IterationEvent.DECODED
        assert np.isneginf(ev.confidence[not_masked]).all() and np.isfinite(ev.confidence[~not_masked]).all()
    for r, res in enumerate(results):
        assert trace.output_ids(r).tolist() == res.token_ids
        assert trace.prompt_ids(r).tolist() == _prompts(engine)[r][1]


def test_recording_does_not_change_the_output(engine):
    engine.set_runtime("lru", "0.5")
    prompts = _prompts(engine)
    plain = [engine.generate_ids(ids, DecodeParams(**PARAMS)).token_ids for _, ids in prompts]
    engine.set_runtime("lru", "0.5")
    _, results = record_trace(engine, prompts, DecodeParams(**PARAMS))
    assert [r.token_ids for r in results] == plain
    assert all(b.experts is engine.manager for b in engine.model.moe_blocks())   # recorder removed


def test_locality_report(lru_trace):
    trace, _, _ = lru_trace
    rep = locality(trace)
    E = trace.header["model"]["num_experts"]
    assert rep["iterations"] == int((trace.fwd_kind == 1).sum())
    assert 0 < rep["unique_experts_per_layer_iteration"]["mean"] <= E
    for part in ("adjacent", "boundary"):
        for key in ("jaccard", "recall"):
            assert 0.0 <= rep[part][key] <= 1.0
    assert rep["adjacent_pairs"] > 0 and rep["boundary_pairs"] > 0
    buckets = rep["tokens_per_expert"]["buckets"]
    assert sum(b["experts"] for b in buckets) == pytest.approx(1.0)
    assert sum(b["pairs"] for b in buckets) == pytest.approx(1.0)
    c = rep["confidence"]
    assert 0.0 <= c["same_iteration_auc"] <= 1.0
    assert sum(b["tokens"] for b in c["bins"]) == c["next_iteration_tokens"]
    text = format_locality(rep)
    for word in ("Unique experts per layer per iteration", "Jaccard", "recall", "Tokens per expert", "AUC"):
        assert word in text


def test_replay_prefetch_without_recorded_predictions_uses_actual_routing(engine, tmp_path):
    trace, _, _ = _record(engine, "lru", "0.25", tmp_path, predictions=False)
    assert not trace.has_predictions and len(trace.pred_ids) == 0
    rep = replay(trace, "prefetch", "0.25")
    assert rep.prediction.startswith("oracle")
    assert sum(r.prefetches for r in rep.stats.records) > 0


def test_auc():
    from oled.trace.locality import auc
    assert auc(np.array([0.1, 0.2, 0.8, 0.9]), np.array([0, 0, 1, 1])) == 1.0
    assert auc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5
    assert auc(np.array([1.0, 2.0]), np.array([1, 1])) is None


def test_trace_cli(tmp_path, capsys):
    from oled.cli import main
    out = tmp_path / "t.trace"
    assert main(["trace", "--random-weights", "tiny", "--prompts", "1", "--gen-length", "16", "--block-length", "16",
                 "--expert-budget", "0.5", "--out", str(out), "--json", str(tmp_path / "loc.json")]) == 0
    captured = capsys.readouterr()
    assert "same hit, load and CPU counts as the live run" in captured.err
    assert "Adjacent iterations" in captured.out
    assert main(["trace", "--report", str(out)]) == 0
    assert "Jaccard" in capsys.readouterr().out
    assert Trace.load(out).num_requests == 1


def test_bad_trace_file(tmp_path):
    bad = tmp_path / "bad.trace"
    bad.write_bytes(b"not a trace")
    with pytest.raises(ValueError):
        Trace.load(bad)
    with pytest.raises(ValueError):
        Trace.load(tmp_path / "missing.trace")


def test_first_requests_of_a_trace(lru_trace, tmp_path, capsys):
    """A trace cut to its first request replays to the live run's records of that request, and drives a model."""
    from oled.cli import main

    trace, _, live_rows = lru_trace
    assert trace.num_requests == 2
    path = tmp_path / "first.trace"
    assert main(["trace", "--report", str(trace.save(tmp_path / "t.trace")), "--first", "1", "--out", str(path)]) == 0
    first = Trace.load(path)
    assert first.num_requests == 1 and first.header["requests"] == trace.header["requests"][:1]
    assert np.array_equal(first.output_ids(0), trace.output_ids(0))
    rows = replay(first, "lru", "0.5").stats.to_rows()
    # (loads_used of a load goes to the record that loaded it, when a later request may hit it: not a prefix's)
    unused = [{k: v for k, v in r.items() if k != "loads_used"} for r in rows + live_rows]
    assert 0 < len(rows) < len(live_rows) and unused[:len(rows)] == unused[len(rows):2 * len(rows)]
    assert len(first.ev_block) < len(trace.ev_block) and first.ev_token.shape == first.ev_state.shape
    capsys.readouterr()
    assert main(["trace", "--report", str(path), "--first", "2", "--out", str(tmp_path / "x.trace")]) == 2
    assert "cannot keep 2" in capsys.readouterr().err


def test_the_runner_up_coverage_records_the_routers_next_ranks_on_the_bundled_model():
    """oled/trace/runner_ups.py (`oled trace --runner-ups M,...`): the wider routing's first k ids are the routed ones in every MoE run (checked
    inside), one logged call per run; more runner-ups name at least as many new experts with at least as many
    candidates; every figure is a fraction where it should be."""
    from oled.config import EngineConfig
    from oled.decoding.params import DecodeParams
    from oled.engine import Engine

    from oled.trace import runner_ups as script

    engine = Engine(EngineConfig(policy="full", expert_budget="1.0", device="cpu", dtype="float32"))
    prompt = engine.tokenizer.encode("def fibonacci(n):\n")
    trace, wide = script.record_with_runner_ups(engine, [("p", prompt)], DecodeParams(gen_length=32, block_length=16),
                                                extra=4)
    k = trace.header["model"]["top_k"]
    assert len(wide) == len(trace.run_layer) > 0 and all(w.shape[1] == k + 4 for w in wide)
    rows = script.coverage(trace, wide, [1, 2, 4])
    assert [r["runner_ups"] for r in rows] == [1, 2, 4] and rows[0]["layer_iterations"] > 0
    for a, b in zip(rows, rows[1:]):
        assert a["recall"] <= b["recall"] and a["candidates_per_layer_iteration"] <= b["candidates_per_layer_iteration"]
    assert all(0 <= r[f] <= 1 for r in rows for f in ("recall", "precision", "random_recall"))
    assert rows[-1]["new_per_layer_iteration"] > 0


def test_the_replay_scripts_trace_selection():
    """oled.trace.selection, the --requests and --expert-mib of the replay scripts under benchmarks/: the first N
    requests' trace, the expert size in bytes or the default, and both options on a parser."""
    import argparse
    from pathlib import Path

    from oled.trace import selection

    path = Path(__file__).parent / "data/tiny-code.trace"
    whole = selection.selected_trace(path, None)
    first = selection.selected_trace(path, 1)
    assert whole.num_requests > 1 and first.num_requests == 1 and len(first.fwd_kind) < len(whole.fwd_kind)
    assert selection.expert_bytes(6, 123) == 6 * 2**20 and selection.expert_bytes(None, 123) == 123
    ap = argparse.ArgumentParser()
    selection.add_selection_args(ap)
    args = ap.parse_args(["--requests", "2", "--expert-mib", "0.5"])
    assert (args.requests, args.expert_mib) == (2, 0.5)
    # the policy-replay scripts' arguments: defaults as given, --costs and --expert-mib only where asked for
    ap = argparse.ArgumentParser()
    selection.add_replay_args(ap, policies="lru,oled", budgets="0.4")
    args = ap.parse_args(["t.trace"])
    assert (args.trace, args.budgets, args.policies, args.capture_slots, args.costs, args.requests,
            args.expert_mib) == ("t.trace", "0.4", "lru,oled", 16, None, None, None)
    assert selection.replay_costs(None) is None
    costs = Path(__file__).parents[1] / "benchmarks/results/h200/s30/call5/grid/results.jsonl.gz"
    assert selection.replay_costs(str(costs)).expert_bytes == 6 * 2**20
    bare = argparse.ArgumentParser()
    selection.add_replay_args(bare, policies="lru", costs=False, expert_mib=False)
    for option in ("--costs", "--expert-mib"):
        with pytest.raises(SystemExit):
            bare.parse_args(["t.trace", option, "1"])
