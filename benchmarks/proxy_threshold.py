"""The routing proxy's commit threshold: the one whose tokens committed per denoising forward come closest to a
target (LLaDA2.0-mini's 2.55), measured on a small calibration set (benchmarks/routing_proxy.sh).

    python benchmarks/proxy_threshold.py --model DIR --thresholds 0.8,0.5,0.2 --refine 3 --out sweep.json

One engine decodes the calibration prompts at each threshold of the sweep, recording their routing. A lower threshold
commits more positions a forward. After the sweep, --refine rounds of bisection between the two thresholds that
bracket the target narrow it further. The calibration prompts are by default the last prompt of the chat, math and
code workloads, which the recorded traces (their first prompts) do not use. For every threshold the sweep keeps the
tokens committed and generated per forward, and the unique experts per MoE layer per iteration (mean and step-to-step
coefficient of variation, proxy_metrics.py). The JSON holds the sweep and the choice; the chosen threshold is the
last line on stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from oled.bench.workloads import load
from oled.config import EngineConfig
from oled.decoding.params import DecodeParams
from oled.engine import Engine
from oled.trace import record_trace
from proxy_metrics import figures

TARGET = 2.55                 # LLaDA2.0-mini: tokens committed per forward (LLaDA2.0-mini-CAP model card)
CALIBRATION = "chat:-1,math:-1,code:-1"


def calibration_prompts(spec: str, tokenizer) -> list[tuple[str, list[int]]]:
    """WORKLOAD:INDEX,... -> [(id, token ids)]."""
    prompts = []
    for item in spec.split(","):
        name, _, index = item.partition(":")
        workload = load(name, tokenizer)
        try:
            p = workload.prompts[int(index or 0)]
        except (ValueError, IndexError):
            raise SystemExit(f"--prompts {item!r}: {name} has {len(workload.prompts)} prompts") from None
        prompts.append((p.id, p.ids(tokenizer)))
    return prompts


def measure(engine, prompts, threshold: float, gen_length: int, block_length: int) -> dict:
    params = DecodeParams(gen_length=gen_length, block_length=block_length, threshold=threshold)
    t0 = time.time()
    trace, _ = record_trace(engine, prompts, params, predictions=False)
    fig = figures(trace)
    row = {"threshold": threshold, "tokens_per_forward": fig["tokens_per_forward"], "iterations": fig["iterations"],
           "unique_experts_per_layer_iteration": fig["unique_experts_per_layer_iteration"],
           "unique_experts_cv": fig["unique_experts_cv_step_to_step"], "seconds": round(time.time() - t0, 1)}
    print(f"threshold {threshold:.4g}: {row['tokens_per_forward']:.2f} tokens per forward, "
          f"{row['iterations']} iterations, "
          f"{row['unique_experts_per_layer_iteration']:.1f} unique experts per layer per iteration "
          f"(CV {row['unique_experts_cv']:.1%}), {row['seconds']:.0f} s", file=sys.stderr, flush=True)
    return row


def bracket(rows: list[dict], target: float) -> tuple[float, float] | None:
    """Adjacent thresholds (low, high) with the target between their tokens per forward, or None."""
    rows = sorted(rows, key=lambda r: r["threshold"])
    for lo, hi in zip(rows, rows[1:]):
        if lo["tokens_per_forward"] >= target >= hi["tokens_per_forward"]:
            return lo["threshold"], hi["threshold"]
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the proxy's checkpoint directory")
    p.add_argument("--thresholds", default="0.8,0.5,0.2", help="the sweep (default: %(default)s)")
    p.add_argument("--refine", type=int, default=3, help="bisection rounds after the sweep (default: %(default)s)")
    p.add_argument("--target", type=float, default=TARGET, help="tokens per forward (default: %(default)s)")
    p.add_argument("--prompts", default=CALIBRATION, help="calibration prompts, WORKLOAD:INDEX,... "
                                                          "(default: %(default)s)")
    p.add_argument("--gen-length", type=int, default=128)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--out", required=True, help="JSON file: the sweep and the choice")
    a = p.parse_args(argv)
    try:
        thresholds = [float(x) for x in a.thresholds.split(",")]
    except ValueError:
        p.error(f"--thresholds {a.thresholds!r}: expected numbers separated by commas")
    if not thresholds or not all(0.0 <= t <= 1.0 for t in thresholds) or a.refine < 0:
        p.error("--thresholds must lie in [0, 1] and --refine must be >= 0")
    engine = Engine(EngineConfig(model=a.model, policy="full"))
    prompts = calibration_prompts(a.prompts, engine.tokenizer)
    rows = [measure(engine, prompts, t, a.gen_length, a.block_length) for t in thresholds]
    for _ in range(a.refine):
        pair = bracket(rows, a.target)
        if pair is None:
            break
        rows.append(measure(engine, prompts, round(sum(pair) / 2, 4), a.gen_length, a.block_length))
    engine.manager.close()
    best = min(rows, key=lambda r: abs(r["tokens_per_forward"] - a.target))
    doc = {"target_tokens_per_forward": a.target, "chosen": best["threshold"],
           "bracketed": bracket(rows, a.target) is not None,
           "calibration_prompts": [pid for pid, _ in prompts], "gen_length": a.gen_length,
           "block_length": a.block_length, "sweep": sorted(rows, key=lambda r: -r["threshold"])}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    if not doc["bracketed"]:
        print(f"no threshold of the sweep brackets {a.target} tokens per forward: the nearest is taken",
              file=sys.stderr)
    print(best["threshold"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
