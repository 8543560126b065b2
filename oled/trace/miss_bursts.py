"""`oled trace --report TRACE --bursts`: how a policy's mapped-path bytes spread over the denoising iterations,
replayed on the CPU: whether the misses come in a few bursts (a block's first iterations, when its all-mask positions
route anew) or in every iteration. It tells where work on the critical path's bytes would have to act: on a block's
first iterations only (the host round trip there, with the CPU's share of the misses), or inside every mapped
forward. Per (policy, budget): the iterations grouped by their step in the block (0: the block's first; the last
group holds every step from --steps on), each group's iterations, mean GB read from host memory an iteration and
share of all the bytes read; and the share held by the heaviest tenth of the iterations. Bytes only, no timing.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..kernels.triton_moe import mapped_rows
from .format import Trace
from .replay import replay_manager


def block_steps(trace: Trace) -> dict[int, int]:
    """forward -> its step in its block, for the trace's denoising iterations (0: the block's first)."""
    steps, block, step = {}, None, 0
    for f in range(len(trace.fwd_kind)):
        info = trace.forward_info(f)
        if info.kind != "iteration":
            continue
        key = (int(trace.fwd_request[f]), info.block_start)
        step = step + 1 if key == block else 0
        block = key
        steps[f] = step
    return steps


def bursts(trace: Trace, policy: str, budget: str, capture_slots: int, expert_bytes: int, last_step: int,
           costs=None) -> dict:
    """One replay on the mapped path with capture_slots; bytes at expert_bytes an expert."""
    mgr = replay_manager(trace, policy, budget, costs, mapped_rows=mapped_rows(True), capture_slots=capture_slots)
    scale = expert_bytes / trace.header["model"]["expert_bytes"]
    per_forward: dict[int, float] = defaultdict(float)
    for r in mgr.replay().records:
        if r.kind == "iteration":
            per_forward[r.forward] += r.bytes_mapped * scale / 1e9
    steps = block_steps(trace)
    total = sum(per_forward.values())
    groups: dict[int, list[float]] = defaultdict(list)
    for f, step in steps.items():
        groups[min(step, last_step)].append(per_forward.get(f, 0.0))
    heaviest = np.sort(np.array([per_forward.get(f, 0.0) for f in steps]))[::-1]
    tenth = max(1, len(heaviest) // 10)
    return {"policy": policy, "budget": budget, "capture_slots": capture_slots, "iterations": len(steps),
            "mapped_gb_per_iteration": total / max(len(steps), 1),
            "by_step": [{"step": s if s < last_step else f"{last_step}+", "iterations": len(v),
                         "mapped_gb_mean": float(np.mean(v)), "share": sum(v) / total if total else 0.0}
                        for s, v in sorted(groups.items())],
            "heaviest_tenth_share": float(heaviest[:tenth].sum() / total) if total else 0.0}


def rows(trace: Trace, policy: str, budget: str, opts) -> list[dict]:
    return [bursts(trace, policy, budget, opts.capture_slots, opts.expert_bytes, opts.steps, opts.costs)]
