"""The routing proxy's metrics , from its training log and its traces.

    python benchmarks/proxy_metrics.py --train-log DIR/train_log.json --trace code=T1 --trace math=T2 \\
        [--block 8=T8 --block 16=T16 --block 24=T24 --block 32=T32] --out metrics.json

Per workload trace (block 32): tokens committed per denoising forward, unique experts per MoE layer per iteration
and how much that count varies step to step (its coefficient of variation over a request's iterations at one layer,
averaged over requests and layers). Per block length: unique experts per MoE layer per iteration over the block's
own rows (a block's first forward also writes the previous block's K/V; those rows are left out, as a per-block
figure should), beside the figures published for LLaDA2.0-mini. Expert load balance over every iteration of every
trace: per layer, the share of experts that receive any token, the busiest expert's load over the mean, and the
coefficient of variation. Last, the workload traces together against LLaDA2.0-mini's published figures at block 32
(TARGETS), each marked in or out of its range.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from oled.trace import Trace
from oled.trace.realism import CV_LAYER, realism

PUBLISHED_UNIQUE = {8: 32, 16: 49, 24: 61, 32: 70}   # LLaDA2.0-mini, unique experts per layer per iteration (approx.)
# LLaDA2.0-mini at block 32 (dMoE, arXiv 2605.30876; the LLaDA2.0-mini-CAP model card): (low, high) of each figure
TARGETS = {"unique_experts_per_layer_iteration": (69.5 - 7.0, 69.5 + 7.0),
           "unique_experts_cv_step_to_step": (0.12, 0.22),
           "tokens_per_forward": (2.55 - 0.3, 2.55 + 0.3)}


def figures(trace: Trace) -> dict:
    """The gating figures of one trace, as `oled trace --report` defines them (oled/trace/realism.py): unique experts
    per MoE layer per iteration forward, their step-to-step CV, output tokens per iteration, and the per-request
    unique counts."""
    rep = realism(trace)
    o = rep["overall"]
    return {"unique_experts_per_layer_iteration": o["unique_experts"], "unique_experts_block": o["unique_experts_block"],
            "unique_experts_cv_step_to_step": o["unique_cv"], f"cv_layer{CV_LAYER}": o["unique_cv_layer10"],
            "tokens_per_forward": o["tokens_per_forward"], "iterations": o["iterations"],
            "generated_tokens": o["generated_tokens"],
            "by_request": [r["unique_experts"] for r in rep["requests"]]}


def gating(traces: list[Trace]) -> dict:
    """The traces together against TARGETS (each trace's figures weighted by its iterations): each figure with its
    range and whether it is inside."""
    parts = [figures(t) for t in traces]
    weights = np.array([p["iterations"] for p in parts], dtype=np.float64)
    pooled = lambda key: float(np.average([p[key] for p in parts], weights=weights))   # noqa: E731
    values = {"unique_experts_per_layer_iteration": pooled("unique_experts_per_layer_iteration"),
              "unique_experts_cv_step_to_step": pooled("unique_experts_cv_step_to_step"),
              "tokens_per_forward": sum(p["generated_tokens"] for p in parts) / max(weights.sum(), 1.0)}
    return {key: {"value": v, "range": TARGETS[key], "inside": TARGETS[key][0] <= v <= TARGETS[key][1]}
            for key, v in values.items()}


def load_balance(traces: list[Trace]) -> dict:
    """Tokens routed to each expert over every denoising iteration of the traces, per layer."""
    E = traces[0].header["model"]["num_experts"]
    per_layer = {}
    for layer in traces[0].layers:
        load = np.zeros(E, dtype=np.int64)
        for t in traces:
            for i in np.flatnonzero((t.run_layer == layer) & (t.fwd_kind[t.run_forward] == 1)):
                load += np.bincount(t.run_ids(i).reshape(-1).astype(np.int64), minlength=E)
        mean = load.mean()
        per_layer[int(layer)] = {"used_share": float((load > 0).mean()), "max_over_mean": float(load.max() / mean),
                                 "cv": float(load.std() / mean)}
    vals = lambda key: [v[key] for v in per_layer.values()]   # noqa: E731
    return {"per_layer": per_layer,
            "mean": {k: float(np.mean(vals(k))) for k in ("used_share", "max_over_mean", "cv")},
            "worst_max_over_mean": float(max(vals("max_over_mean")))}


def _pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, eq, path = item.partition("=")
        if not eq:
            raise SystemExit(f"expected NAME=TRACE, got {item!r}")
        out[key] = path
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-log", required=True)
    p.add_argument("--trace", action="append", default=[], metavar="WORKLOAD=TRACE")
    p.add_argument("--block", action="append", default=[], metavar="LENGTH=TRACE")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    log = json.load(open(a.train_log))
    workloads = {name: Trace.load(path) for name, path in _pairs(a.trace).items()}
    blocks = {int(b): Trace.load(path) for b, path in _pairs(a.block).items()}
    heldout = log.get("heldout", {})
    doc = {
        "training": {k: log.get(k) for k in ("wall_time_s", "train_time_s", "steps", "tokens_seen",
                                             "final_train_loss", "params", "expert_bias_abs_max", "recipe")},
        "heldout": {ratio: {"loss": v["loss"], "acc": v["acc"]} for ratio, v in heldout.items()},
        "config": log.get("config"),
        "workloads": {name: dict(figures(t), requests=t.num_requests,
                                 threshold=t.header["decode"].get("threshold"))
                      for name, t in workloads.items()},
        "unique_experts_by_block": {b: dict(figures(t), published_llada2_mini=PUBLISHED_UNIQUE.get(b))
                                    for b, t in sorted(blocks.items())},
        "load_balance": load_balance(list(workloads.values()) or list(blocks.values())),
        "against_llada2_mini": gating(list(workloads.values())) if workloads else {},
    }
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"held-out (mask ratio: loss / accuracy): "
          + ", ".join(f"{r}: {v['loss']:.3f} / {v['acc']:.3f}" for r, v in doc["heldout"].items()))
    for name, w in doc["workloads"].items():
        print(f"{name}: {w['requests']} requests, {w['generated_tokens']} tokens, {w['iterations']} iterations at "
              f"threshold {w['threshold']}, {w['tokens_per_forward']:.2f} tokens per forward, "
              f"{w['unique_experts_per_layer_iteration']:.1f} unique experts per layer per iteration "
              f"(by request {', '.join(f'{x:.1f}' for x in w['by_request'])}; step-to-step CV "
              f"{w['unique_experts_cv_step_to_step']:.1%}, at layer {CV_LAYER} {w[f'cv_layer{CV_LAYER}'] or 0:.1%})")
    for b, u in doc["unique_experts_by_block"].items():
        print(f"block {b}: {u['unique_experts_block']:.1f} unique experts per layer per iteration over the block's "
              f"rows (LLaDA2.0-mini published ~{u['published_llada2_mini']}), {u['tokens_per_forward']:.2f} tokens "
              f"per forward")
    lb = doc["load_balance"]
    print(f"load balance: {lb['mean']['used_share']:.1%} of experts used per layer, busiest expert "
          f"{lb['mean']['max_over_mean']:.2f}x the mean (worst layer {lb['worst_max_over_mean']:.2f}x), "
          f"CV {lb['mean']['cv']:.2f}")
    for key, g in doc["against_llada2_mini"].items():
        print(f"{'all traces' if len(workloads) > 1 else 'the trace'}: {key} {g['value']:.3g}, LLaDA2.0-mini range "
              f"{g['range'][0]:.3g}-{g['range'][1]:.3g}: {'inside' if g['inside'] else 'OUTSIDE'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
