"""Forward graphs (oled/decoding/graphs.py): which forwards are captured and replayed, segments around the offloaded
path's host round trips, the persistent KV cache, statistics and the eager fallback. CUDA graphs need a GPU, so
these tests use tests/graph_emulator.py, which gives replays CUDA-graph semantics on the CPU (only recorded tensor
operations rerun); the H200 smoke check (benchmarks/h200_smoke.py) compares real replays with eager forwards."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import oled
from oled.decoding import graphs as graphs_mod
from oled.decoding.model_runner import ModelRunner
from oled.decoding.loop import generate

from .costs import balanced_costs
from .graph_emulator import EmulatedGraphs

PROMPT = "hello world, how are you today?"


@pytest.fixture(scope="module")
def llm():
    return oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="full")


def _run(llm, runner=None, gen_length=64, threshold=0.95):
    """One request on `runner` (None: the engine's, which runs every forward eagerly on the CPU)."""
    eng = llm.engine
    eng.manager.stats.reset()
    params = oled.DecodeParams(gen_length=gen_length, threshold=threshold)
    res = generate(runner or eng.runner, eng.tokenizer.encode(PROMPT), params)
    timed = ("cpu_ms_per_iteration", "cpu_cost_model_ratio", "cpu_path_cost_model_ratio")     # wall times: differ between any two runs
    return res, {k: v for k, v in eng.manager.stats.summary().items() if k not in timed}


def _block_of(eng, prompt_tokens: int, length: int = 32) -> torch.Tensor:
    """The first prompt_tokens of PROMPT followed by masks: `length` tokens."""
    ids = eng.tokenizer.encode(PROMPT)[:prompt_tokens]
    return torch.from_numpy(np.array(ids + [eng.config.mask_token_id] * (length - len(ids))))


def _runner(llm, backend=None, **kw) -> ModelRunner:
    """A model runner on the engine's model and manager whose graphs run on the CPU emulator."""
    eng = llm.engine
    runner = ModelRunner(eng.model, graph_backend=backend or EmulatedGraphs(), **kw)
    runner.attach(eng.manager)
    return runner


def test_replayed_forwards_give_the_eager_tokens_and_statistics(llm):
    llm.engine.set_runtime("full", "1.0")
    eager, eager_stats = _run(llm, None)
    runner = _runner(llm)
    replayed, stats = _run(llm, runner)
    assert replayed.token_ids == eager.token_ids
    assert replayed.nfe == eager.nfe
    assert stats == eager_stats                        # routing read back from the replays counts like eager
    # Shapes do not depend on the block's position: every steady-state iteration (one block of tokens) shares one
    # graph, captured at its first use; every later block's first forward (the finished block's K/V write fused with
    # the new block's iteration) shares another, captured at its second use. Only the first of those runs eagerly.
    assert len(PROMPT) < 32 and eager.cache_forwards == 0 and eager.prefill_s >= 0   # no prefill forward
    later_blocks = len(eager.iterations_per_block) - 1
    assert later_blocks >= 2, "the test needs a fused forward that comes back"
    assert runner.graphs.captures == 2
    assert runner.graphs.replays == eager.nfe - 1
    assert runner.graphs.backend.segments == runner.graphs.captures   # a static placement: one segment per forward


@pytest.mark.parametrize("policy,budget", [("lru", "0.25"), ("lru", "0.0625"), ("prefetch", "0.25"),
                                           ("tide", "0.25"), ("fiddler", "0.25"), ("lru:cooperative", "0.25")])
def test_segmented_replays_of_offloaded_forwards(llm, policy, budget):
    """Offloaded forwards replay segment by segment with the manager's host steps in between: same tokens and the
    same hit/miss/copy statistics as eager forwards (0.0625 = one slot per layer: several waves per layer)."""
    options = {}
    if policy == "fiddler":                             # popularity of a full run
        llm.engine.set_runtime("full", "1.0")
        _run(llm, None)
        options = {"popularity": llm.engine.manager.stats.popularity()}
    if policy.endswith(":cooperative"):                 # loads and CPU jobs in the same layers
        policy, options = policy.split(":")[0], {"misses": "cooperative"}
        llm.engine.costs = balanced_costs(llm.engine.store.expert_bytes)
    llm.engine.set_runtime(policy, budget, **options)
    eager, eager_stats = _run(llm, None)
    llm.engine.set_runtime(policy, budget, **options)   # the same cold cache for the replayed run
    runner = _runner(llm)
    replayed, stats = _run(llm, runner)
    assert replayed.token_ids == eager.token_ids
    assert stats == eager_stats                         # hits, misses, copies, CPU pairs: the same decisions
    moe_layers = len(llm.engine.config.moe_layers)
    assert runner.graphs.replays > 0
    assert runner.graphs.backend.segments == runner.graphs.captures * (2 * moe_layers + 1)   # two host steps per MoE layer
    if options.get("misses") == "cooperative":
        assert stats["totals"]["loads"] > 0 and stats["totals"]["pairs_cpu"] > 0


@pytest.mark.parametrize("skipped", ["decide", "finish"])
def test_a_replay_that_skipped_a_host_step_would_be_caught(llm, monkeypatch, skipped):
    """The emulator's replays run only recorded tensor operations: if a host step's result did not reach the
    buffer the next segment reads, replayed logits would differ from eager ones. (At 4 slots per layer a layer's
    experts take several waves, so the finish step has rows to write.)"""
    llm.engine.set_runtime("lru", "0.25")
    eng = llm.engine
    runner = _runner(llm)
    kv = runner.kv_cache(64)
    ids, rows = _block_of(eng, prompt_tokens=8), slice(0, 32)
    eager = eng.model(ids, 0, kv, 32, rows).clone()
    runner.graphs(ids, 0, kv, 32, rows)                         # first use: eager
    captured = runner.graphs(ids, 0, kv, 32, rows).clone()      # captured and replayed
    assert torch.equal(captured, eager)
    torch.testing.assert_close(runner.graphs(ids, 0, kv, 32, rows), eager, rtol=0, atol=0)
    other = ids.flip(0)                                  # other routing, more experts per layer than slots
    other_eager = eng.model(other, 0, kv, 32, rows).clone()
    assert torch.equal(runner.graphs(other, 0, kv, 32, rows), other_eager)
    runner.graphs(ids, 0, kv, 32, rows)
    monkeypatch.setattr(graphs_mod._Finish, "run", lambda self, manager: None)
    if skipped == "decide":
        monkeypatch.setattr(graphs_mod._Decide, "run", lambda self, manager: None)
    # the buffers the segments read still hold the slots or rows computed for `ids`
    assert not torch.allclose(runner.graphs(other, 0, kv, 32, rows), other_eager)


def test_kv_cache_persists_and_grows(llm):
    llm.engine.set_runtime("full", "1.0")
    runner = _runner(llm, max_graphs=1)
    first, _ = _run(llm, runner, gen_length=32)
    kv = runner.kv
    second, _ = _run(llm, runner, gen_length=32)
    assert runner.kv is kv and second.token_ids == first.token_ids     # same cache, same addresses for graphs
    assert len(runner.graphs.graphs) <= 1 and runner.graphs.backend.released >= 1   # bounded: older graphs are released
    longer, _ = _run(llm, runner, gen_length=260)      # past the first key bucket: a new, larger cache
    assert runner.kv is not kv and runner.kv.max_len > kv.max_len
    eager, _ = _run(llm, None, gen_length=260)
    assert longer.token_ids == eager.token_ids


@pytest.mark.parametrize("fail", [True, "during"])
def test_failed_capture_falls_back_to_eager(llm, caplog, fail):
    """A capture that cannot begin, or whose first operation fails inside it: the forward and the rest run eagerly
    with eager's tokens and statistics, and the failed capture is ended before the capturing region is left (under
    CUDA an open capture makes the stream switch back and every later launch fail)."""
    llm.engine.set_runtime("full", "1.0")
    eager, eager_stats = _run(llm, None)
    backend = EmulatedGraphs(fail_capture=fail)
    runner = _runner(llm, backend=backend)
    with caplog.at_level("WARNING", logger="oled"):
        res, stats = _run(llm, runner)
    assert res.token_ids == eager.token_ids and stats == eager_stats
    assert not runner.graphs.enabled and runner.graphs.replays == 0
    assert "CUDA graph capture failed" in caplog.text
    assert backend.left_open == 0 and backend.open is None


def test_engine_uses_graphs_only_on_cuda(llm):
    llm.engine.set_runtime("full", "1.0")
    assert llm.engine.graphs is None                   # CPU: nothing to capture
    assert oled.EngineConfig().cuda_graphs is True and oled.EngineConfig().offload_graphs is True


def test_a_backend_that_needs_an_eager_first_forward_gets_one(llm):
    """CUDA graphs capture nothing before one eager forward (cuBLAS makes its handles on first use, which a capture
    does not allow): with a short prompt the first forward is a steady-state iteration, captured at once otherwise."""
    llm.engine.set_runtime("full", "1.0")
    backend = EmulatedGraphs()
    backend.needs_eager_first = True
    runner = _runner(llm, backend)
    eager, _ = _run(llm, None)
    replayed, _ = _run(llm, runner)
    assert replayed.token_ids == eager.token_ids
    assert runner.graphs.captures == 2
    assert runner.graphs.replays == eager.nfe - 2          # the first forward and the first fused forward ran eagerly


def test_one_off_shapes_are_captured_only_when_they_come_back(llm):
    llm.engine.set_runtime("full", "1.0")
    eng = llm.engine
    runner = _runner(llm)
    kv = runner.kv_cache(64)
    ids = torch.from_numpy(np.array(eng.tokenizer.encode(PROMPT)[:40] + [eng.config.mask_token_id] * 24)[:64])
    one_off = slice(32, None)                            # a block's K/V write fused with the next block's iteration
    eager = eng.model(ids, 0, kv, 64, one_off).clone()
    assert torch.equal(runner.graphs(ids, 0, kv, 64, one_off), eager) and runner.graphs.captures == 0
    assert torch.equal(runner.graphs(ids, 0, kv, 64, one_off), eager) and runner.graphs.captures == 1
    steady = slice(0, None)
    runner.graphs(ids[32:], 32, kv, 64, steady)
    assert runner.graphs.captures == 2                          # a steady-state iteration: captured at once


def test_one_graph_serves_every_position(llm):
    """A steady-state forward captured at one block replays at any other: positions and the visible key end are
    inputs of the graph, not constants baked into it (the emulator reruns only recorded operations)."""
    llm.engine.set_runtime("full", "1.0")
    eng = llm.engine
    runner = _runner(llm)
    kv = runner.kv_cache(160)
    gen = torch.Generator().manual_seed(3)
    for start in (0, 32, 64, 96, 128):
        ids = torch.randint(0, eng.config.vocab_size, (32,), generator=gen)
        eager = eng.model(ids, start, kv, start + 32, slice(0, None)).clone()   # also writes this block's K/V
        assert torch.equal(runner.graphs(ids, start, kv, start + 32, slice(0, None)), eager)
    assert runner.graphs.captures == 1 and runner.graphs.replays == 5


def test_the_block_length_is_part_of_a_graphs_key(llm):
    """The block-causal mask's block length is a constant of a captured forward: a forward of the same shape at
    another block length gets a graph of its own, and the tokens of its own mask."""
    llm.engine.set_runtime("full", "1.0")
    eng = llm.engine
    runner = _runner(llm)
    kv = runner.kv_cache(64)
    ids, rows = _block_of(eng, prompt_tokens=20), slice(0, 32)
    eager = {B: eng.model(ids, 0, kv, 32, rows, block_length=B).clone() for B in (8, 32)}
    eng.manager.end_forward()
    assert not torch.allclose(eager[8], eager[32])
    for B in (8, 32, 8):
        assert torch.equal(runner.graphs(ids, 0, kv, 32, rows, block_length=B), eager[B])
        eng.manager.end_forward()
    assert runner.graphs.captures == 2 and runner.graphs.replays == 3
