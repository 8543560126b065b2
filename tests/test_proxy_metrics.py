"""The routing proxy's gating statistics (benchmarks/proxy_metrics.py): the figures of `oled trace --report`
(unique experts per MoE layer per iteration, their step-to-step CV, output tokens per iteration) pooled over traces
and judged against LLaDA2.0-mini's ranges."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from oled.trace import Trace
from oled.trace.realism import realism

from .scripts import benchmark_script

TRACE = Path(__file__).parent / "data" / "tiny-code.trace"


@pytest.fixture(scope="module")
def metrics():
    return benchmark_script("proxy_metrics")


def test_gating_on_one_trace_is_the_reports_overall(metrics):
    t = Trace.load(TRACE)
    g = metrics.gating([t])
    overall = realism(t)["overall"]
    iterations = int((t.fwd_kind == 1).sum())
    assert g["tokens_per_forward"]["value"] == pytest.approx(len(t.req_output_ids) / iterations)
    assert g["unique_experts_per_layer_iteration"]["value"] == pytest.approx(overall["unique_experts"])
    assert g["unique_experts_cv_step_to_step"]["value"] == pytest.approx(overall["unique_cv"])
    for key, (lo, hi) in metrics.TARGETS.items():
        assert g[key]["inside"] == (lo <= g[key]["value"] <= hi)


def test_gating_pools_traces_by_their_iterations(metrics):
    t = Trace.load(TRACE)
    one, two = metrics.figures(t), metrics.figures(t.first_requests(1))
    g = metrics.gating([t, t.first_requests(1)])
    w = np.array([one["iterations"], two["iterations"]], dtype=np.float64)
    assert two["iterations"] < one["iterations"]
    expected = np.average([one["unique_experts_per_layer_iteration"], two["unique_experts_per_layer_iteration"]],
                          weights=w)
    assert g["unique_experts_per_layer_iteration"]["value"] == pytest.approx(expected)
    assert g["tokens_per_forward"]["value"] == pytest.approx(
        (one["generated_tokens"] + two["generated_tokens"]) / w.sum())
