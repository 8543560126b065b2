"""The routing proxy's gating statistics (benchmarks/proxy_metrics.py): unique experts per MoE layer per iteration,
their step-to-step coefficient of variation, tokens committed per forward, against LLaDA2.0-mini's ranges."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from oled.trace import Trace

from .scripts import benchmark_script

TRACE = Path(__file__).parent / "data" / "tiny-code.trace"


@pytest.fixture(scope="module")
def metrics():
    return benchmark_script("proxy_metrics")


def test_step_to_step_cv_is_per_request_and_layer(metrics):
    counts = np.array([10, 30, 20, 20, 50, 50])      # request 0: layer 1 (10, 30), layer 2 (20, 20); request 1 ...
    requests = np.array([0, 0, 0, 0, 1, 1])
    layers = np.array([1, 1, 2, 2, 1, 1])
    # request 0 layer 1: std 10 / mean 20; request 0 layer 2: 0; request 1 layer 1: 0
    assert metrics.step_to_step_cv(counts, requests, layers) == pytest.approx(0.5 / 3)
    assert metrics.step_to_step_cv(counts, requests, layers, layer=1) == pytest.approx(0.25)


def test_gating_on_a_trace(metrics):
    t = Trace.load(TRACE)
    g = metrics.gating([t])
    iterations = np.flatnonzero(t.fwd_kind == 1)
    committed = sum(int((t.event(j).state == 2).sum()) for j in range(len(t.ev_forward)))
    assert g["tokens_per_forward"]["value"] == pytest.approx(committed / len(iterations))
    counts, requests, layers = metrics.block_unique_counts(t)
    assert len(counts) == len(iterations) * len(t.layers)
    first = np.flatnonzero(t.run_forward == iterations[0])[0]       # the first iteration's first MoE layer
    f = iterations[0]
    own = t.run_ids(first)[t.fwd_start[f] + np.arange(t.fwd_tokens[f]) >= t.fwd_block_start[f]]
    assert counts[0] == len(np.unique(own))
    assert g["unique_experts_per_layer_iteration"]["value"] == pytest.approx(counts.mean())
    for key, (lo, hi) in metrics.TARGETS.items():
        assert g[key]["inside"] == (lo <= g[key]["value"] <= hi)
