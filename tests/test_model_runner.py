"""The model runner (oled/decoding/model_runner.py): the one owner of the KV cache, the graphs and the MoE layers'
expert backend. Graph replays are emulated on the CPU (tests/graph_emulator.py)."""
from __future__ import annotations

import pytest

import oled
from oled.decoding.loop import generate
from oled.decoding.model_runner import ModelRunner

from .graph_emulator import EmulatedGraphs

PROMPT = "hello world, how are you today?"


@pytest.fixture(scope="module")
def llm():
    return oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="lru", expert_budget="0.25")


class _Counting:
    """A stand-in around the manager: counts the MoE layers' calls and forwards the rest."""

    def __init__(self, manager):
        self.manager, self.layers = manager, []

    def __getattr__(self, name):
        return getattr(self.__dict__["manager"], name)

    def run(self, layer, *args, **kwargs):
        self.layers.append(layer)
        return self.manager.run(layer, *args, **kwargs)


def test_attach_wires_every_moe_layer_and_a_new_runtime_rewires_them(llm):
    eng = llm.engine
    blocks = eng.model.moe_blocks()
    old = eng.manager
    assert all(b.experts is old for b in blocks) and eng.runner.manager is old
    assert set(old.predictors) == {b.layer_idx for b in blocks}
    eng.set_runtime("lru", "0.5")
    assert eng.manager is not old and all(b.experts is eng.manager for b in blocks)
    assert eng.runner.experts is eng.manager
    eng.set_runtime("lru", "0.25")


def test_a_stand_in_sees_every_layer_runs_eagerly_and_is_put_back(llm):
    eng = llm.engine
    runner = ModelRunner(eng.model, graph_backend=EmulatedGraphs())
    runner.attach(eng.manager)
    params = oled.DecodeParams(gen_length=32)
    ids = eng.tokenizer.encode(PROMPT)
    plain = generate(runner, ids, params)
    replays = runner.graphs.replays
    assert replays > 0
    stand_in = _Counting(eng.manager)
    with runner.borrowed(stand_in):
        assert runner.experts is stand_in
        lent = generate(runner, ids, params)
        with pytest.raises(RuntimeError, match="already lent"):
            with runner.borrowed(_Counting(eng.manager)):
                pass
    assert lent.token_ids == plain.token_ids
    layers = [b.layer_idx for b in eng.model.moe_blocks()]
    forwards = lent.nfe + lent.cache_forwards
    assert stand_in.layers == layers * forwards          # every layer of every forward: none was replayed
    assert runner.graphs.replays == replays
    assert runner.experts is eng.manager and all(b.experts is eng.manager for b in eng.model.moe_blocks())
    with pytest.raises(ZeroDivisionError), runner.borrowed(_Counting(eng.manager)):
        1 / 0
    assert all(b.experts is eng.manager for b in eng.model.moe_blocks())   # put back after a failure too
    eng.runner.attach(eng.manager)


def test_the_kv_cache_is_kept_across_requests_and_a_longer_one_leaves_nothing_behind(llm):
    """The runner keeps one KV cache: a request after a longer one runs on keys the longer one wrote past its own
    end. They are masked, so its tokens are those of a fresh runner's."""
    eng = llm.engine
    ids = eng.tokenizer.encode(PROMPT)
    short = oled.DecodeParams(gen_length=32)
    fresh = ModelRunner(eng.model)
    fresh.attach(eng.manager)
    want = generate(fresh, ids, short).token_ids
    runner = ModelRunner(eng.model)
    runner.attach(eng.manager)
    generate(runner, eng.tokenizer.encode("a different and much longer prompt " * 4), oled.DecodeParams(gen_length=96))
    kv = runner.kv
    assert generate(runner, ids, short).token_ids == want
    assert runner.kv is kv                               # no new cache for a request that fits
    grown = runner.kv_cache(kv.max_len + 1)
    assert grown is not kv and grown.max_len > kv.max_len
    eng.runner.attach(eng.manager)


def test_a_routing_source_drops_the_graphs(llm):
    eng = llm.engine
    runner = ModelRunner(eng.model, graph_backend=EmulatedGraphs())
    runner.attach(eng.manager)
    generate(runner, eng.tokenizer.encode(PROMPT), oled.DecodeParams(gen_length=32))
    assert runner.graphs.graphs
    runner.set_routing_source(None)
    assert not runner.graphs.graphs
    eng.runner.attach(eng.manager)


def test_graphs_are_made_only_where_they_can_run():
    eng = oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="full").engine
    assert ModelRunner(eng.model).cuda_graphs is False            # CPU, no emulator: eager
    runner = ModelRunner(eng.model, offload_graphs=False, graph_backend=EmulatedGraphs())
    runner.attach(eng.manager)
    assert runner.graphs is not None and not runner.graphs.segmented   # every expert resident: one graph
    eng.set_runtime("lru", "0.25")
    runner.attach(eng.manager)
    assert runner.graphs is None                                  # offloaded, offload_graphs off


def test_offload_graphs_is_read_by_each_set_runtime():
    """EngineConfig.offload_graphs switched between runs (as benchmarks/h200_smoke.py does) takes effect at the next
    set_runtime: offloaded forwards eager when off, segmented graphs when on."""
    eng = oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="full").engine
    eng.runner.graph_backend, eng.runner.cuda_graphs = EmulatedGraphs(), True     # graphs on the CPU
    eng.cfg.offload_graphs = False
    eng.set_runtime("lru", "0.25")
    assert eng.graphs is None
    eng.cfg.offload_graphs = True
    eng.set_runtime("lru", "0.25")
    assert eng.graphs is not None and eng.graphs.segmented

class _SharedOrder(_Counting):
    """A stand-in that records, per MoE layer, when the layer asks for its shared expert (shared_ahead, before it
    routes) and when the backend runs it."""

    def __init__(self, manager):
        super().__init__(manager)
        self.events = []

    def shared_ahead(self, x, shared):
        self.events.append(("ahead", len(self.layers)))
        given = self.manager.shared_ahead(x, shared)

        def run_shared(x):
            self.events.append(("shared", len(self.layers)))
            return given(x)
        return run_shared


def test_each_moe_layer_asks_for_its_shared_expert_before_it_routes_and_the_backend_runs_it_once():
    """MoEBlock hands the backend its shared expert before routing (so a CUDA backend can queue it on a second
    stream beside the router, ExpertManager.shared_ahead); the backend runs what it gets back exactly once, inside
    the layer's run. On the CPU there is no second stream, and the tokens are the plain run's."""
    llm = oled.LLM(device="cpu", dtype="float32", policy="full")       # the bundled model: one shared expert
    eng = llm.engine
    assert eng.cfg.shared_stream and eng.manager.shared_stream is None
    assert all(b.shared is not None for b in eng.model.moe_blocks())
    ids = eng.tokenizer.encode(PROMPT)
    params = oled.DecodeParams(gen_length=32)
    plain = generate(eng.runner, ids, params)
    stand_in = _SharedOrder(eng.manager)
    with eng.runner.borrowed(stand_in):
        lent = generate(eng.runner, ids, params)
    assert lent.token_ids == plain.token_ids
    calls = len(stand_in.layers)
    assert calls == len(eng.model.moe_blocks()) * (lent.nfe + lent.cache_forwards) > 0
    # per layer call i: asked for before its run (i layers run so far), run inside it (i + 1 once run() counted it)
    assert stand_in.events == [e for i in range(calls) for e in (("ahead", i), ("shared", i + 1))]
