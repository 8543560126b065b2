"""The CPU cost feedback (runtime/cpu_feedback.py): each forward plans its CPU jobs on the start-up cost model with
its CPU terms scaled by the median ratio of the recent jobs' time in the engine to the model's prediction; a trace
records each forward's scale and its replay plans on it."""
from __future__ import annotations

import math

import numpy as np
import pytest

import oled
from oled.decoding.params import DecodeParams
from oled.runtime import cpu_feedback
from oled.runtime.cost_model import CostModel
from oled.runtime.cpu_feedback import STEP, CpuCostFeedback, quantise
from oled.runtime.planner import PlanInputs, plan_cost, split_misses
from oled.runtime.stats import TIMINGS
from oled.trace import Trace, record_trace, replay

from .costs import balanced_costs


def test_the_scale_is_the_quantised_median_of_the_recent_ratios():
    fb = CpuCostFeedback()
    for _ in range(cpu_feedback.MIN_JOBS - 1):
        fb.observe(3e-4, 1e-4)
    assert fb.next_scale() == 1.0                         # too few jobs: the model as measured
    fb.observe(3e-4, 1e-4)
    assert fb.next_scale() == pytest.approx(quantise(3.0)) and abs(fb.scale / 3.0 - 1) < STEP - 1
    for _ in range(cpu_feedback.WINDOW // 2 - 1):         # most of the window very slow: the median follows, within
        fb.observe(1.0, 1e-4)                             # the range
    assert fb.next_scale() == cpu_feedback.SCALE_RANGE[1]
    for _ in range(cpu_feedback.WINDOW):
        fb.observe(2e-4, 1e-4)
    assert fb.next_scale() == pytest.approx(2.0)          # a power of STEP: 2 = STEP ** 8
    fb.observe(float("nan"), 1e-4)
    fb.observe(1e-4, 0.0)                                 # no prediction: nothing to compare
    assert len(fb.ratios) == cpu_feedback.WINDOW and fb.next_scale() == pytest.approx(2.0)
    assert quantise(1e-9) == cpu_feedback.SCALE_RANGE[0] and quantise(1.02) == 1.0
    assert math.log2(quantise(1.3)) * cpu_feedback.STEPS_PER_DOUBLING == pytest.approx(3)   # 1.3 = STEP ** 3.03


def test_a_scaled_model_scales_only_the_cpu_kernel_terms_and_the_planner_follows_it():
    base = CostModel(expert_bytes=1 << 20, h2d_gbps=10.0, cpu_seconds={1: 30e-6, 8: 80e-6}, cpu_call_seconds=10e-6,
                     transfer_seconds=5e-6, gpu_seconds={1: 1e-6, 8: 2e-6})
    assert base.with_cpu_scale(1.0) is base and base.with_cpu_scale(2.0) is base.with_cpu_scale(2.0)
    slow = base.with_cpu_scale(2.0)
    for t in (1, 3, 8, 20):
        assert slow.cpu_expert_seconds(t) == pytest.approx(2 * base.cpu_expert_seconds(t))
        assert slow.gpu_expert_seconds(t) == base.gpu_expert_seconds(t)
    assert slow.cpu_call_seconds == 2 * base.cpu_call_seconds and slow.load_seconds(3) == base.load_seconds(3)
    assert slow.transfer_seconds == base.transfer_seconds and slow.h2d_gbps == base.h2d_gbps
    # a load takes 105 µs (+ 1 on the GPU), a one-token expert 30 µs on the CPU, 10 per call, 5 for the transfer:
    # as measured both misses go to the CPU (75 µs against max(106, 45) for one load); at twice the CPU time one of
    # them loads (max(106, 85) against 145)
    inputs = PlanInputs(tokens={3: 1, 7: 1}, rows=2, free_slots=0, max_loads=2)
    assert split_misses(inputs, base) == ([], [3, 7])
    load, cpu = split_misses(inputs, slow)
    assert len(load) == 1 and len(cpu) == 1
    assert plan_cost(load, cpu, inputs, slow) < plan_cost([], [3, 7], inputs, slow)


def _llm(feedback: bool):
    llm = oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="lru", expert_budget="0.25",
                   cpu_threads=1, cpu_cost_feedback=feedback)
    eng = llm.engine
    # predictions far below what the kernel takes on any machine: the feedback must raise the scale
    eng.costs = balanced_costs(eng.store.expert_bytes, seconds=1e-8)
    eng.set_runtime("oled", "0.25")
    return llm


@pytest.mark.parametrize("feedback", [True, False])
def test_the_engine_scales_its_cpu_costs_by_what_its_jobs_take(tmp_path, feedback):
    """With predictions 10 ns per expert, the jobs' observed time raises the scale to the top of its range (with
    feedback) or leaves it at 1; the tokens are those of `full` either way, and a trace records every forward's scale,
    which its replay plans on: the replay's decisions are the live run's."""
    llm = _llm(feedback)
    eng = llm.engine
    prompts = [("p0", eng.tokenizer.encode("def fib(n):\n")), ("p1", eng.tokenizer.encode("Hello there"))]
    trace, results = record_trace(eng, prompts, DecodeParams(gen_length=32, block_length=16))
    live_rows = eng.manager.stats.to_rows()
    trace = Trace.load(trace.save(tmp_path / "oled.trace"))
    scales = trace.fwd_cpu_scale
    assert len(scales) == len(trace.fwd_kind)
    if feedback:
        assert scales[0] == 1.0 and scales[-1] == cpu_feedback.SCALE_RANGE[1]
        assert np.all(np.diff(scales) >= 0)       # every job ran slower than predicted: the scale only rises
    else:
        assert np.all(scales == 1.0) and eng.manager.cpu_feedback is None
    assert sum(r["pairs_cpu"] for r in live_rows) > 0
    assert replay(trace, "oled", "0.25").stats.to_rows() == [dict(r, **dict.fromkeys(TIMINGS, 0.0))
                                                               for r in live_rows]
    eng.set_runtime("full", "1.0")
    for (_, ids), res in zip(prompts, results):
        assert eng.generate_ids(ids, DecodeParams(gen_length=32, block_length=16)).token_ids == res.token_ids
