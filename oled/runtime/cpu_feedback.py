"""The CPU path as the engine sees it, against the cost model: a per-forward correction of the model's CPU terms.

The start-up cost model times the CPU kernel alone (cost_model.measure). In the engine a job also waits for the
kernel's workers to wake and shares the host with the main thread's launches, copies and policy steps, so the
planner can send misses to the CPU that a load would have served sooner.

So the expert manager reports each CPU job's time from its submission to its result next to the model's prediction,
and before each forward the planner's CPU terms are scaled by the median ratio of the last WINDOW jobs: a forward
plans on one scale, quantised to steps of STEP so that noise does not change decisions, within SCALE_RANGE. Plain
Python. The scale of each forward is recorded in a trace, and its replay plans on it, so a replay reaches the live
run's decisions. Off by default (EngineConfig.cpu_cost_feedback; docs/decisions.md: cpu-cost-feedback-off).
"""
from __future__ import annotations

import math
import statistics
from collections import deque

WINDOW = 32                  # jobs the median is taken over: recent enough to follow the machine, robust to spikes
MIN_JOBS = 4                 # fewer observed jobs leave the scale where it is
SCALE_RANGE = (0.5, 8.0)     # a ratio beyond these is a measurement gone wrong, not a machine
STEPS_PER_DOUBLING = 8       # scales are powers of 2 ** (1 / 8), about 9 % apart
STEP = 2 ** (1 / STEPS_PER_DOUBLING)


def quantise(ratio: float) -> float:
    """The nearest power of STEP within SCALE_RANGE (exact at powers of two)."""
    lo, hi = SCALE_RANGE
    ratio = min(max(ratio, lo), hi)
    return 2.0 ** (round(math.log2(ratio) * STEPS_PER_DOUBLING) / STEPS_PER_DOUBLING)


class CpuCostFeedback:
    def __init__(self):
        self.ratios: deque[float] = deque(maxlen=WINDOW)
        self.scale = 1.0

    def observe(self, measured_s: float, predicted_s: float) -> None:
        """One CPU job: its time from submission to result, and the cost model's prediction of it."""
        if predicted_s > 0 and math.isfinite(measured_s) and measured_s > 0:
            self.ratios.append(measured_s / predicted_s)

    def next_scale(self) -> float:
        """The scale the next forward plans on."""
        if len(self.ratios) >= MIN_JOBS:
            self.scale = quantise(statistics.median(self.ratios))
        return self.scale
