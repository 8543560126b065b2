"""Replaying a trace's routing and commits on another model of the same shapes (oled/trace/source.py,
`oled bench --routing`).

Traces are recorded on one random-weights tiny model and replayed on another (other seed, so its own router and
decoder would route and commit differently): the MoE layers must receive the recorded ids and weights exactly, the loop
must commit the recorded tokens, and each policy's statistics must be those of the live run that was recorded."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from oled.cli import main as cli_main
from oled.config import EngineConfig
from oled.decoding.model_runner import ModelRunner
from oled.decoding.loop import generate
from oled.decoding.params import DecodeParams
from oled.engine import Engine
from oled.runtime.stats import TIMINGS
from oled.trace import Trace, record_trace
from oled.trace.source import TraceMismatch, TraceSource

from .costs import balanced_costs
from .graph_emulator import EmulatedGraphs
from .scripts import benchmark_script

PROMPTS = ["def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "Hello there, how are you today?"]
PARAMS = dict(gen_length=40, block_length=16)


def _engine(seed):
    eng = Engine(EngineConfig(random_weights="tiny", seed=seed, expert_budget="0.5", policy="lru", dtype="float32"))
    eng.costs = balanced_costs(eng.store.expert_bytes)      # the cooperative policies plan on fixed costs
    return eng


@pytest.fixture(scope="module")
def recorder():
    eng = _engine(0)
    yield eng
    eng.manager.close()


@pytest.fixture(scope="module")
def player():
    eng = _engine(1)
    yield eng
    eng.manager.close()


def _record(eng, policy, budget, path, **options):
    eng.set_runtime(policy, budget, **options)
    prompts = [(f"p{i}", eng.tokenizer.encode(p)) for i, p in enumerate(PROMPTS)]
    trace, results = record_trace(eng, prompts, DecodeParams(**PARAMS))
    return Trace.load(trace.save(path)), eng.manager.stats.to_rows()


@pytest.fixture(scope="module")
def lru_trace(recorder, tmp_path_factory):
    return _record(recorder, "lru", "0.25", tmp_path_factory.mktemp("routing") / "lru.trace")


def _replay(eng, trace, policy, budget, runner=None, **options):
    """Every request of the trace on `eng` with the trace's routing and commits; (results, per-layer rows).
    runner(eng) -> the model runner to decode on (None: the engine's)."""
    source = TraceSource(trace, eng.config, eng.device)
    eng.set_runtime(policy, budget, **options)
    eng.set_routing_source(source)
    try:
        params, results = source.decode_params(), []
        for r in range(source.num_requests):
            source.begin_request(r)
            on = runner(eng) if runner else eng.runner
            results.append(generate(on, source.prompt_ids(r), params, commits=source))
        return results, eng.manager.stats.to_rows()
    finally:
        eng.set_routing_source(None)


def test_the_other_model_would_route_and_decode_differently(recorder, player, lru_trace):
    """Without the source the player's own router and decoder disagree with the trace (else the tests below prove
    nothing)."""
    trace, _ = lru_trace
    player.set_runtime("lru", "0.25")
    own = generate(player.runner, list(trace.prompt_ids(0)), DecodeParams(**PARAMS))
    assert own.token_ids != trace.output_ids(0).tolist()
    assert player.manager.stats.to_rows() != lru_trace[1][: len(player.manager.stats.to_rows())]


def test_layers_receive_the_recorded_routing_and_the_loop_commits_the_recorded_tokens(player, lru_trace):
    trace, _ = lru_trace
    player.set_runtime("lru", "0.25")
    manager = player.manager
    seen, events = [], []
    run, on_iteration = manager.run, manager.on_iteration
    manager.run = lambda layer, x, ids, w, shared=None: (seen.append((layer, ids.clone(), w.clone()))
                                                         or run(layer, x, ids, w, shared))
    manager.on_iteration = lambda ev: events.append(ev) or on_iteration(ev)
    source = TraceSource(trace, player.config, player.device)
    player.set_routing_source(source)
    try:
        for r in range(source.num_requests):
            source.begin_request(r)
            res = generate(player.runner, source.prompt_ids(r), source.decode_params(), commits=source)
            assert res.token_ids == trace.output_ids(r).tolist()
    finally:
        player.set_routing_source(None)
        del manager.run, manager.on_iteration
    assert [layer for layer, _, _ in seen] == trace.run_layer.tolist()
    ids = torch.cat([i for _, i, _ in seen]).numpy()
    weights = torch.cat([w for _, _, w in seen]).float().numpy()
    assert np.array_equal(ids, trace.ids.astype(np.int64))              # exactly the recorded ids ...
    assert np.array_equal(weights, trace.weights)                        # ... and weights, bit for bit
    assert len(events) == len(trace.ev_block)
    for j, ev in enumerate(events):
        rec = trace.event(j)
        assert np.array_equal(ev.state, rec.state)
        assert np.array_equal(ev.tokens, rec.tokens)                     # the recorded commits, token for token
        assert np.array_equal(ev.confidence, rec.confidence)             # and the recorded confidences


@pytest.mark.parametrize("policy,budget", [("lru", "0.25"), ("lfu", "0.25"), ("prefetch", "0.25"), ("tide", "0.25"),
                                           ("oled", "0.25"), ("oled-retain", "0.125")])
def test_replayed_run_gives_the_live_runs_statistics(recorder, player, tmp_path, policy, budget):
    trace, live_rows = _record(recorder, policy, budget, tmp_path / f"{policy}.trace")
    _, rows = _replay(player, trace, policy, budget)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMINGS} for r in rs]   # noqa: E731 wall times
    assert strip(rows) == strip(live_rows)
    assert sum(r["pairs"] - r["pairs_hit"] for r in rows) > 0            # the budget really misses


@pytest.mark.parametrize("policy,budget", [("full", "1.0"), ("lru", "0.25")])
def test_captured_graphs_replay_the_current_forwards_routing(player, lru_trace, policy, budget):
    """A graph reads the routing from the source's fixed buffers, so each replay uses its own forward's routing:
    the same statistics as eager forwards."""
    trace, _ = lru_trace
    eager, eager_rows = _replay(player, trace, policy, budget)
    runners = []

    def make(eng):
        if not runners:
            runners.append(ModelRunner(eng.model, graph_backend=EmulatedGraphs()))
            runners[0].attach(eng.manager)
        return runners[0]
    replayed, rows = _replay(player, trace, policy, budget, runner=make)
    graphs = runners[0].graphs
    assert graphs.replays > graphs.captures > 0
    assert [r.token_ids for r in replayed] == [r.token_ids for r in eager]
    assert rows == eager_rows if policy == "full" else \
        [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows] == \
        [{k: v for k, v in r.items() if k not in TIMINGS} for r in eager_rows]


def test_a_trace_of_other_shapes_is_refused(lru_trace):
    trace, _ = lru_trace
    other = Engine(EngineConfig(random_weights="tiny", layers=5, policy="full", dtype="float32"))
    with pytest.raises(TraceMismatch, match=r"does not fit this model \(4 MoE layers"):
        TraceSource(trace, other.config, other.device)


def test_a_run_that_leaves_the_trace_is_stopped(player, lru_trace):
    trace, _ = lru_trace
    source = TraceSource(trace, player.config, player.device)
    player.set_runtime("lru", "0.25")
    params = DecodeParams(**dict(PARAMS, block_length=8))          # not what was recorded: other forwards
    source.begin_request(0)
    player.set_routing_source(source)
    try:
        with pytest.raises(TraceMismatch, match="the trace has a"):
            generate(player.runner, source.prompt_ids(0), params, commits=source)
        source.begin_request(1)                                     # another request's prompt for request 1
        with pytest.raises(TraceMismatch):
            generate(player.runner, source.prompt_ids(0), source.decode_params(), commits=source)
    finally:
        player.set_routing_source(None)


def test_old_traces_without_tokens_are_refused(lru_trace, player):
    trace, _ = lru_trace
    old = Trace(**{**trace.__dict__, "ev_token": None})
    with pytest.raises(TraceMismatch, match="committed tokens"):
        TraceSource(old, player.config, player.device)


def test_bench_routing_cli(lru_trace, tmp_path, capsys):
    """One `oled bench --routing` command: the trace's requests, every run's tokens those of the trace, belady's
    bounds beside them (no more misses than lru's); a model of other shapes gets one line and exit 2."""
    trace, _ = lru_trace
    path = tmp_path / "t.trace"
    trace.save(path)
    out = tmp_path / "bench"
    rc = cli_main(["bench", "--routing", str(path), "--random-weights", "tiny", "--seed", "5", "--dtype", "float32",
                   "--policies", "full,lru", "--budgets", "1.0,0.25", "--repeats", "1", "--no-progress",
                   "--no-profile", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by = {(r["policy"], r["budget"]): r["metrics"] for r in rows}
    assert set(by) >= {("full", "1.0"), ("lru", "0.25"), ("bound:belady-even", "0.25"), ("bound:belady-shared", "0.25")}
    misses = {k: m["misses_per_iteration"]["median"] for k, m in by.items()}
    assert misses["bound:belady-shared", "0.25"] <= misses["bound:belady-even", "0.25"] <= misses["lru", "0.25"]
    for r in rows:
        assert r["model"]["routing"]["requests"] == trace.num_requests
        assert r["decode"]["block_length"] == PARAMS["block_length"]
        if r["mode"] == "live":
            assert [p["generated_tokens"] for p in r["prompts"]] == \
                [len(trace.output_ids(i)) for i in range(trace.num_requests)]
    capsys.readouterr()
    rc = cli_main(["bench", "--routing", str(path), "--random-weights", "tiny", "--layers", "5", "--policies", "full",
                   "--no-progress", "--out", str(tmp_path / "b2")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "does not fit this model" in err[0]


def test_trace_header_carries_what_a_routing_replay_needs(lru_trace, recorder):
    trace, _ = lru_trace
    m = trace.header["model"]
    assert (m["vocab_size"], m["mask_token_id"], m["eos_token_id"]) == \
        (recorder.config.vocab_size, recorder.config.mask_token_id, recorder.config.eos_token_id)
    # ev_token holds each block's tokens after the iteration: a finished block holds the request's final tokens
    assert trace.ev_token.shape == trace.ev_state.shape
    checked = 0
    for j in np.flatnonzero(trace.ev_done):
        f = int(trace.ev_forward[j])
        r = int(trace.fwd_request[f])
        final = np.concatenate([trace.prompt_ids(r), trace.output_ids(r)])
        bs = int(trace.fwd_block_start[f])
        tokens = trace.event(j).tokens
        n = min(len(tokens), len(final) - bs)
        if n > 0:
            assert np.array_equal(tokens[:n], final[bs:bs + n])
            checked += 1
    assert checked >= 2


def test_forward_gaps_replays_the_traces_first_request(player, lru_trace, tmp_path):
    """benchmarks/forward_gaps.py --routing: its decode() runs the trace's first request with the recorded routing and
    commits and gives the recorded tokens, twice in a row (a warm-up, then the timed generate)."""

    trace, _ = lru_trace
    path = trace.save(tmp_path / "first.trace")
    gaps = benchmark_script("forward_gaps")
    player.set_runtime("lru", "0.25")
    try:
        decode = gaps.replayed_request(player, str(path))
        expected = TraceSource(trace, player.config, player.device).output_ids(0)
        assert [decode().token_ids for _ in range(2)] == [expected, expected]
    finally:
        player.set_routing_source(None)
