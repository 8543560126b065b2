"""Predictions several MoE layers ahead in a trace (format 2): what each layer's router makes of the inputs of the 1,
2 and 3 MoE layers before it, recorded, saved compactly, sliced, and exposed by the CPU replayer and the routing
source; traces of format 1 (one layer ahead) still load.

The reference is the router itself in fp32 (oled.models.router.sigmoid_group_route) applied to the inputs the MoE
blocks received, caught by a forward pre-hook on every block while the trace was recorded."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from oled.config import EngineConfig
from oled.decoding.params import DecodeParams
from oled.engine import Engine
from oled.models.router import sigmoid_group_route
from oled.trace import Trace, record_trace
from oled.trace.format import FORMAT, PREDICTION_DISTANCES
from oled.trace.replay import replay_manager
from oled.trace.source import TraceSource

PROMPTS = ["def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "Hello there, how are you today?"]
PARAMS = dict(gen_length=32, block_length=16)
MOE_LAYERS = 5                   # layers of the random tiny model: 1 dense + 5 MoE, so 3 layers ahead exist
OLD_TRACE = Path(__file__).parent / "data" / "tiny-code.trace"       # format 1


@pytest.fixture(scope="module")
def engine():
    eng = Engine(EngineConfig(random_weights="tiny", dtype="float32", layers=MOE_LAYERS + 1, expert_budget="0.5",
                              policy="lru"))
    yield eng
    eng.manager.close()


@pytest.fixture(scope="module")
def recorded(engine, tmp_path_factory):
    """(trace as saved and loaded, every MoE block's inputs in call order: [(layer, x)])."""
    inputs = []
    hooks = [block.register_forward_pre_hook(lambda block, args: inputs.append((block.layer_idx,
                                                                                args[0].detach().clone())))
             for block in engine.model.moe_blocks()]
    try:
        prompts = [(f"p{i}", engine.tokenizer.encode(p)) for i, p in enumerate(PROMPTS)]
        trace, _ = record_trace(engine, prompts, DecodeParams(**PARAMS))
    finally:
        for h in hooks:
            h.remove()
    path = trace.save(tmp_path_factory.mktemp("pred") / "t.trace")
    return Trace.load(path), inputs


def _router(engine, layer: int, x: torch.Tensor) -> np.ndarray:
    """The router of `layer` on x, in fp32: ids [T, k], each row sorted."""
    c = engine.config
    block = {b.layer_idx: b for b in engine.model.moe_blocks()}[layer]
    ids, _ = sigmoid_group_route(x.float(), block.router_weight.float(), block.expert_bias.float(), top_k=c.top_k,
                                 n_group=c.n_group, topk_group=c.topk_group,
                                 routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob)
    return np.sort(ids.numpy(), axis=1)


def test_predictions_are_the_later_layers_routers_on_this_layers_input(engine, recorded):
    trace, inputs = recorded
    layers = trace.layers
    assert len(layers) == MOE_LAYERS and trace.header["format"] == FORMAT
    assert trace.prediction_distances == PREDICTION_DISTANCES == 3
    assert [layer for layer, _ in inputs] == trace.run_layer.tolist()      # one block input per recorded run
    checked = differ_from_actual = 0
    for i, (layer, x) in enumerate(inputs):
        p = layers.index(layer)
        assert np.array_equal(np.sort(trace.run_ids(i), axis=1), _router(engine, layer, x))   # its own routing
        for d in range(1, PREDICTION_DISTANCES + 1):
            pred = trace.run_pred(i, d)
            if p + d >= len(layers):
                assert pred is None
                continue
            assert pred.shape == trace.run_ids(i).shape
            assert np.array_equal(np.sort(pred, axis=1), _router(engine, layers[p + d], x))
            actual = np.sort(trace.run_ids(i + d), axis=1)       # that layer's own routing in the same forward
            differ_from_actual += not np.array_equal(np.sort(pred, axis=1), actual)
            checked += 1
    runs = len(inputs)
    assert checked == sum(runs // len(layers) * max(len(layers) - d, 0) for d in range(1, 4))
    assert differ_from_actual > 0          # a prediction is not the routing it predicts


def test_predictions_are_stored_compactly_and_sliced_with_their_requests(recorded, tmp_path):
    trace, _ = recorded
    for d in range(1, 4):
        assert trace.run_pred(0, d).dtype == np.uint8      # 16 experts: one byte an id
    first = trace.first_requests(1)
    again = Trace.load(first.save(tmp_path / "first.trace"))
    runs = len(again.run_layer)
    assert 0 < runs < len(trace.run_layer) and again.prediction_distances == 3
    for i in range(runs):
        for d in range(1, 4):
            a, b = again.run_pred(i, d), trace.run_pred(i, d)
            assert (a is None and b is None) or np.array_equal(a, b)
    with pytest.raises(ValueError, match="1 to 3"):
        trace.run_pred(0, 4)


def test_replayer_and_routing_source_expose_every_distance(engine, recorded):
    trace, _ = recorded
    mgr = replay_manager(trace, "lru", "0.5")
    source = TraceSource(trace, engine.config, "cpu")
    L = len(trace.layers)
    f = int(np.flatnonzero(trace.fwd_kind == 1)[0])       # the first denoising iteration
    source.begin_request(0)
    source._forward = f - 1                               # stage forward f as the decoding loop would
    source.begin_forward(trace.forward_info(f))
    x = torch.zeros(int(trace.fwd_tokens[f]), 1)
    for p in range(L):
        i = f * L + p
        for d in range(1, 4):
            assert (mgr.predicted(i, d) is None) == (p + d >= L)
            if p + d < L:
                assert np.array_equal(mgr.predicted(i, d), trace.run_pred(i, d))
                staged, _ = source.predicted(trace.layers[p + d], x, ahead=d)
                assert np.array_equal(staged.numpy(), trace.run_pred(i, d))


def test_traces_of_format_1_load_and_fall_back_to_the_actual_routing_beyond_one_layer():
    old = Trace.load(OLD_TRACE)
    assert old.header["format"] == "oled-trace/1" and old.prediction_distances == 1
    assert old.run_pred(0).dtype == np.int16 and old.run_pred(0, 2) is None
    mgr = replay_manager(old, "prefetch", "0.5")     # (its replays are pinned by tests/test_oled.py's digests)
    assert np.array_equal(mgr.predicted(0), old.run_pred(0))
    assert np.array_equal(mgr.predicted(0, 2), old.run_ids(2))      # oracle: the MoE layer 2 ahead's own routing
