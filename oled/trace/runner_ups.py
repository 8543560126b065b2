"""`oled trace --runner-ups M,...`: how many of the experts a layer newly routes to at the next denoising iteration
its router had already ranked just below the top-k at this one, on a model run on this machine (the bundled trained
model by default: real learned routing).

An iteration-ahead prefetch needs a prediction of each layer's new experts. The routing history names few of them
(oled/trace/ahead_coverage.py); the routers' runner-ups are the other candidate, and a trace does not record them, so
this records a trace with the model's own router and, for every MoE call, the top (k + M) experts of the same
routing rule (LLaDA2's group limit included). Per pair of consecutive iterations of a block and per layer: new = the
experts routed at t+1 and not at t; candidates(m) = the experts ranked k+1 .. k+m by some row at t and not routed at
t. Reports, per m, the share of new experts among the candidates (recall), the candidates per layer and iteration,
the share of candidates that are new (precision), and the recall that as many experts drawn at random from those not
routed at t would reach.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..models import moe
from . import record_trace
from .format import KINDS


def record_with_runner_ups(engine, prompts, params, extra: int, **record_options):
    """A trace of `prompts` (no next-layer predictions) and, per MoE call in the trace's run order, the top
    (k + extra) ids of the same routing rule [T, k + extra]. record_options go to record_trace (workload,
    on_prompt)."""
    logged = []
    inner = moe.route

    def route(config, hidden, weight, bias, fused=False):
        out = inner(config, hidden, weight, bias, fused=fused)
        wide, _ = inner(replace(config, top_k=config.top_k + extra), hidden, weight, bias)
        logged.append(wide.cpu().numpy())
        return out

    moe.route = route
    try:
        trace, _ = record_trace(engine, prompts, params, predictions=False, **record_options)
    finally:
        moe.route = inner
    if len(logged) != len(trace.run_layer):
        raise RuntimeError(f"{len(logged)} router calls for {len(trace.run_layer)} recorded MoE runs")
    k = int(trace.header["model"]["top_k"])
    for i, wide in enumerate(logged):
        if not np.array_equal(np.sort(wide[:, :k], axis=1), np.sort(trace.run_ids(i), axis=1)):
            raise RuntimeError(f"MoE run {i}: the wider routing's first {k} ids are not the routed ones")
    return trace, logged


def coverage(trace, wide: list[np.ndarray], runner_ups: list[int]) -> list[dict]:
    """One row per m in runner_ups (each at most the recorded extra)."""
    k = int(trace.header["model"]["top_k"])
    num_experts = int(trace.header["model"]["num_experts"])
    iteration = KINDS.index("iteration")
    runs_of: dict[int, dict[int, int]] = {}
    for i, (f, layer) in enumerate(zip(trace.run_forward.tolist(), trace.run_layer.tolist())):
        runs_of.setdefault(f, {})[layer] = i
    forwards = [f for f in range(len(trace.fwd_kind)) if trace.fwd_kind[f] == iteration]
    new_total, pairs = 0, 0
    hits = dict.fromkeys(runner_ups, 0)
    candidates = dict.fromkeys(runner_ups, 0)
    random_hits = dict.fromkeys(runner_ups, 0.0)
    for a, b in zip(forwards, forwards[1:]):
        if trace.fwd_request[a] != trace.fwd_request[b] or trace.fwd_block_start[a] != trace.fwd_block_start[b]:
            continue                              # the next block starts all-mask: not the same positions' routing
        for layer, ia in runs_of[a].items():
            ib = runs_of[b].get(layer)
            if ib is None:
                continue
            routed = set(wide[ia][:, :k].reshape(-1).tolist())
            new = set(wide[ib][:, :k].reshape(-1).tolist()) - routed
            new_total += len(new)
            pairs += 1
            unrouted = num_experts - len(routed)
            for m in runner_ups:
                cand = set(wide[ia][:, k:k + m].reshape(-1).tolist()) - routed
                hits[m] += len(new & cand)
                candidates[m] += len(cand)
                random_hits[m] += len(new) * len(cand) / max(unrouted, 1)
    return [{"runner_ups": m, "layer_iterations": pairs, "new_per_layer_iteration": new_total / max(pairs, 1),
             "recall": hits[m] / max(new_total, 1), "candidates_per_layer_iteration": candidates[m] / max(pairs, 1),
             "precision": hits[m] / max(candidates[m], 1), "random_recall": random_hits[m] / max(new_total, 1)}
            for m in runner_ups]
