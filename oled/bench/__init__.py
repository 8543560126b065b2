"""Benchmarks: `oled bench` (policies x budgets x workloads side by side, JSON Lines, Markdown report, plots).

    from oled import EngineConfig
    from oled.bench import BenchConfig, run_bench, render
    rows = run_bench(BenchConfig(engine=EngineConfig(random_weights="tiny"), policies=["full", "lru"],
                                 budgets=["1.0", "0.5"], workloads=["code"], out="/tmp/bench"))
"""
from __future__ import annotations

from .metrics import METRICS
from .report import render
from .runner import Bench, BenchConfig, PolicySpec, run_bench

__all__ = ["Bench", "BenchConfig", "PolicySpec", "run_bench", "render", "METRICS"]
