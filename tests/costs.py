"""Cost models for tests that need the planner to use both sides whatever this machine measures."""
from __future__ import annotations

from oled.runtime.cost_model import CostModel


def balanced_costs(expert_bytes: int, seconds: float = 1e-4) -> CostModel:
    """Loading an expert and computing one on the CPU take the same time, with no call or GPU cost: the planner then
    splits a layer's misses about evenly between loads and the CPU (as far as free slots allow)."""
    return CostModel(expert_bytes=expert_bytes, h2d_gbps=expert_bytes / seconds / 1e9,
                     cpu_seconds={1: seconds, 32: seconds}, source="test: balanced")
