"""Forward graphs (oled/decoding/graphs.py): which forwards are captured and replayed, the persistent KV cache, and
statistics, with a stand-in backend whose "replay" reruns the captured forward eagerly (CUDA graphs need a GPU; the
H200 smoke check compares real graph replays with eager forwards token for token)."""
from __future__ import annotations

import pytest
import torch

import oled
from oled.decoding.graphs import ForwardGraphs
from oled.decoding.loop import generate

PROMPT = "hello world, how are you today?"


class ReplayByRerun:
    """Backend for CPU tests: capture runs the forward once; replay reruns it and writes the results (logits and the
    routing the capture logged) into the captured tensors, as a CUDA graph replay writes into its static outputs."""

    def __init__(self, manager, fail: bool = False):
        self.manager, self.fail = manager, fail
        self.released = 0

    def capture(self, fn):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        mark = self.manager.routing_mark()
        out = fn()
        return _Rerun(fn, out, list(self.manager._routing_log[mark:]), self.manager), out

    def release(self, graph):
        self.released += 1


class _Rerun:
    def __init__(self, fn, out, routing, manager):
        self.fn, self.out, self.routing, self.manager = fn, out, routing, manager

    def replay(self):
        with torch.inference_mode():
            mark = self.manager.routing_mark()
            res = self.fn()
            for (_, old), (_, new) in zip(self.routing, self.manager.take_routing(mark)):
                old.copy_(new)
            self.out.copy_(res)


@pytest.fixture(scope="module")
def llm():
    return oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="full")


def _run(llm, graphs, gen_length=64, threshold=0.95):
    eng = llm.engine
    eng.manager.stats.reset()
    params = oled.DecodeParams(gen_length=gen_length, threshold=threshold)
    res = generate(eng.model, eng.manager, eng.tokenizer.encode(PROMPT), params, graphs=graphs)
    return res, eng.manager.stats.summary()


def test_replayed_forwards_give_the_eager_tokens_and_statistics(llm):
    eager, eager_stats = _run(llm, None)
    graphs = ForwardGraphs(llm.engine.model, llm.engine.manager, backend=ReplayByRerun(llm.engine.manager))
    replayed, stats = _run(llm, graphs)
    assert replayed.token_ids == eager.token_ids
    assert replayed.nfe == eager.nfe
    assert stats == eager_stats                        # routing read back from the replays counts like eager
    # A shape is captured at its second use and replayed from then on. The first block's forwards all have one
    # shape; a later block's first forward also writes the finished block's K/V (a shape used once), then repeats.
    first, *later = eager.iterations_per_block
    assert later, "the test needs at least two blocks"
    assert graphs.captures == (first >= 2) + sum(n >= 3 for n in later)
    assert graphs.replays == (first - 1) + sum(max(n - 2, 0) for n in later)
    assert graphs.replays > 0


def test_kv_cache_persists_and_grows(llm):
    backend = ReplayByRerun(llm.engine.manager)
    graphs = ForwardGraphs(llm.engine.model, llm.engine.manager, backend=backend, max_graphs=1)
    first, _ = _run(llm, graphs, gen_length=32)
    kv = graphs.kv
    second, _ = _run(llm, graphs, gen_length=32)
    assert graphs.kv is kv and second.token_ids == first.token_ids     # same cache, same addresses for graphs
    assert len(graphs.graphs) <= 1 and backend.released >= 1          # bounded: older graphs are released
    longer, _ = _run(llm, graphs, gen_length=96)
    assert graphs.kv is not kv and graphs.kv.max_len >= kv.max_len + 64
    eager, _ = _run(llm, None, gen_length=96)
    assert longer.token_ids == eager.token_ids


def test_failed_capture_falls_back_to_eager(llm, caplog):
    eager, eager_stats = _run(llm, None)
    graphs = ForwardGraphs(llm.engine.model, llm.engine.manager, backend=ReplayByRerun(llm.engine.manager, fail=True))
    with caplog.at_level("WARNING", logger="oled"):
        res, stats = _run(llm, graphs)
    assert res.token_ids == eager.token_ids and stats == eager_stats
    assert not graphs.enabled and graphs.replays == 0
    assert "CUDA graph capture failed" in caplog.text


def test_engine_uses_graphs_only_for_static_placements_on_cuda(llm):
    assert llm.engine.graphs is None                   # CPU: nothing to capture
    assert oled.EngineConfig().cuda_graphs is True
