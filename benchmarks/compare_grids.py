"""Two `oled bench` grids cell by cell, and the OLED issue's targets in the newer one: the check a session runs
against the last committed grid before it stops.

    python benchmarks/compare_grids.py REF NEW [--tolerance 1.03] [--budget 0.4] [--json FILE]

REF and NEW are result folders (results.jsonl, or its gzipped copy). For every live cell (policy, budget) present in
both it prints ms per token in each, NEW's time a forward over REF's (a cell's decoded sequence, and with it its
number of forwards, may differ between codes, so the ratio is taken a forward), the bytes it read from host memory
(mapped) and copied (H2D) an iteration in each, and its token agreement. A cell slower than the tolerance a forward
is said to be either "same bytes" (the same decisions moved the same data: spread between processes, or a change
of the forward's own cost) or "bytes differ" (its decisions changed). A grid's card is its rows' label: when the two
differ (an H100 against an H200) the ratios compare machines, not codes, and the script says so. Each grid's cost
model (measured at start-up in its process) gives the machine's copy rate and the kernels' read of one expert from
host memory (`mapped_seconds`); where the reads differ, each cell's change a forward is set beside what the read alone
predicts (its experts read an iteration times the difference), with the fit of one against the other.

The targets at --budget, in NEW: oled's ms per token over `full`'s (at most 1.15) and the best baseline's over oled's
(at least 1.5; the baselines are every live policy but full and oled's variants); and for every live policy at the
budget, in misses and time against the grid's bound rows (oled/bounds.py): its misses an iteration over belady's
(`bound:belady-even`, the budget split evenly across layers as the runtime splits it; and over the shared pool's),
the fraction of the experts it loaded that were used before their slot was given up, and its ms per token over each
time bound's (`bound:demand-*`, `bound:prefetch-*`, `bound:floor-*`). A grid without bound rows (older ones: a
`belady` replay row) gets the time targets only.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from oled.bench.report import read_jsonl

OLED_VARIANTS = ("oled", "oled-retain", "oled-coop")
TARGETS = {"tpot_over_full": 1.15, "best_baseline_over_oled": 1.5}
MISS_BOUNDS = ("bound:belady-even", "bound:belady-shared")


def cells(folder) -> tuple[dict[tuple[str, str], dict], dict[tuple[str, str], dict], set[str]]:
    """(live cells by (policy label, budget): their row; the bound rows by (bound, budget); the grid's card labels)."""
    rows = [r for r in read_jsonl(Path(folder) / "results.jsonl") if r.get("status", "ok") == "ok"]
    live = {(r["policy_label"], r["budget"]): r for r in rows if r["mode"] == "live" and r.get("metrics")}
    bound = {(r["policy_label"], r["budget"]): r for r in rows
             if r["mode"] == "bound" and r.get("metrics") and r["policy"].startswith("bound:")}
    return live, bound, {r.get("label", "?") for r in rows}


def link(live: dict) -> dict | None:
    """The grid's measured copy rate and mapped read of one expert (the first cost model among its rows)."""
    for row in live.values():
        costs = row.get("cost_model") or {}
        if costs.get("mapped_seconds"):
            return {"h2d_gbps": costs["h2d_gbps"], "mapped_seconds": costs["mapped_seconds"],
                    "expert_bytes": costs["expert_bytes"]}
    return None


def median(row: dict, metric: str) -> float | None:
    value = (row["metrics"].get(metric) or {}).get("median")
    return None if value is None else float(value)


def compare(ref: dict, new: dict, tolerance: float) -> list[dict]:
    """One entry per cell in both grids, in NEW's order; with both grids' mapped reads known, read_delta_ms: the
    change a forward the difference of the two reads alone predicts for the cell's reads."""
    out = []
    reads = (link(ref), link(new))
    extra_read_s = None if None in reads else reads[1]["mapped_seconds"] - reads[0]["mapped_seconds"]
    for key, row in new.items():
        if key not in ref:
            continue
        old = ref[key]
        forward_ms, ref_forward_ms = median(row, "ms_per_forward"), median(old, "ms_per_forward")
        same_bytes = all(round(median(row, m) or 0.0, 4) == round(median(old, m) or 0.0, 4)
                         for m in ("mapped_gb_per_iteration", "h2d_gb_per_iteration"))
        out.append({"policy": key[0], "budget": key[1], "tpot_ms": median(row, "tpot_ms"),
                    "ref_tpot_ms": median(old, "tpot_ms"), "forward_ratio": forward_ms / ref_forward_ms,
                    "mapped_gb": median(row, "mapped_gb_per_iteration"),
                    "ref_mapped_gb": median(old, "mapped_gb_per_iteration"),
                    "h2d_gb": median(row, "h2d_gb_per_iteration"), "ref_h2d_gb": median(old, "h2d_gb_per_iteration"),
                    "agreement": median(row, "token_agreement"), "same_bytes": same_bytes,
                    "slower": forward_ms / ref_forward_ms > tolerance, "delta_ms": forward_ms - ref_forward_ms,
                    "read_delta_ms": None if extra_read_s is None else
                    (median(row, "mapped_gb_per_iteration") or 0.0) * 1e9 / reads[1]["expert_bytes"]
                    * extra_read_s * 1e3})
    return out


def targets(live: dict, bound: dict, budget: str) -> dict | None:
    """The OLED issue's targets at `budget` in one grid; None when it lacks oled or full there."""
    oled, full = live.get(("oled", budget)), live.get(("full", "1.0"))
    if oled is None or full is None:
        return None
    baselines = {label: row for (label, b), row in live.items()
                 if b == budget and row["policy"] not in OLED_VARIANTS + ("full",)}
    out = {"oled_tpot_ms": median(oled, "tpot_ms"), "full_tpot_ms": median(full, "tpot_ms")}
    out["tpot_over_full"] = out["oled_tpot_ms"] / out["full_tpot_ms"]
    if baselines:
        best = min(baselines, key=lambda label: median(baselines[label], "tpot_ms"))
        out["best_baseline"], out["best_baseline_tpot_ms"] = best, median(baselines[best], "tpot_ms")
        out["best_baseline_over_oled"] = out["best_baseline_tpot_ms"] / out["oled_tpot_ms"]
    out["against_bounds"] = against_bounds(live, bound, budget)
    return out


def against_bounds(live: dict, bound: dict, budget: str) -> dict[str, dict]:
    """Per live policy at `budget`: misses an iteration, over each miss bound's, the used-before-evicted fraction, and
    ms per token over each time bound's (the ratios only where the bound row is in the grid)."""
    misses = {name: median(bound[name, budget], "misses_per_iteration")
              for name in MISS_BOUNDS if (name, budget) in bound}
    times = {name: median(row, "tpot_ms") for (name, b), row in bound.items()
             if b == budget and median(row, "tpot_ms") is not None}
    out = {}
    for (label, b), row in live.items():
        if b != budget:
            continue
        m, tpot = median(row, "misses_per_iteration"), median(row, "tpot_ms")
        out[label] = {"misses_per_iteration": m, "used_before_evicted": median(row, "used_before_evicted"),
                      "tpot_ms": tpot,
                      "misses_over": {name: m / v for name, v in misses.items() if m is not None and v},
                      "tpot_over": {name: tpot / v for name, v in times.items() if tpot is not None and v}}
    return out


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_against_bounds(rows: dict[str, dict], budget: str) -> None:
    if not rows:
        return
    names = sorted({n for r in rows.values() for n in r["tpot_over"]})
    print(f"  against the bounds at {budget}: misses an iteration over belady's (even split, shared pool), "
          f"used-before-evicted fraction, ms per token over each time bound's")
    print(f"  {'policy':24s} {'misses':>8s} {'/even':>7s} {'/shared':>7s} {'used':>6s} "
          + " ".join(f"{n.removeprefix('bound:'):>18s}" for n in names))
    for label, r in rows.items():
        used = r["used_before_evicted"]
        print(f"  {label:24s} {_ratio(r['misses_per_iteration']):>8s} "
              f"{_ratio(r['misses_over'].get('bound:belady-even')):>7s} "
              f"{_ratio(r['misses_over'].get('bound:belady-shared')):>7s} {'-' if used is None else f'{used:.3f}':>6s} "
              + " ".join(f"{_ratio(r['tpot_over'].get(n)):>18s}" for n in names))


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref", help="the reference grid's folder (the last committed one)")
    ap.add_argument("new", help="the new grid's folder")
    ap.add_argument("--tolerance", type=float, default=1.03,
                    help="a cell is slower when NEW's time a forward is over this times REF's (default 1.03)")
    ap.add_argument("--budget", default="0.4", help="the budget the targets are judged at (default 0.4)")
    ap.add_argument("--json", help="also write the comparison and the targets to this file")
    args = ap.parse_args(argv)
    (ref, _, ref_cards), (new, new_bound, new_cards) = cells(args.ref), cells(args.new)
    rows = compare(ref, new, args.tolerance)
    if not rows:
        print(f"compare_grids: no live cell is in both {args.ref} and {args.new}", file=sys.stderr)
        return 1
    print(f"REF {args.ref}: {', '.join(sorted(ref_cards))}\nNEW {args.new}: {', '.join(sorted(new_cards))}")
    if ref_cards != new_cards:
        print("the grids ran on different cards: the ratios compare machines as well as codes")
    for name, grid in (("REF", ref), ("NEW", new)):
        if (m := link(grid)) is not None:
            print(f"{name} cost model: copies {m['h2d_gbps']:.1f} GB/s, the kernels' read of an expert "
                  f"{m['mapped_seconds'] * 1e6:.1f} us ({m['expert_bytes'] / m['mapped_seconds'] / 1e9:.1f} GB/s)")
    print(f"{'policy':24s} {'budget':>6s} {'ms/token':>9s} {'(ref)':>9s} {'fwd x':>7s} {'mapped GB':>10s} {'(ref)':>8s} "
          f"{'H2D GB':>8s} {'(ref)':>8s} {'agree':>6s}")
    for r in rows:
        flag = "" if not r["slower"] else ("  slower, same bytes" if r["same_bytes"] else "  slower, bytes differ")
        print(f"{r['policy']:24s} {r['budget']:>6s} {r['tpot_ms']:9.3f} {r['ref_tpot_ms']:9.3f} "
              f"{r['forward_ratio']:7.3f} {_gb(r['mapped_gb']):>10s} {_gb(r['ref_mapped_gb']):>8s} "
              f"{_gb(r['h2d_gb']):>8s} {_gb(r['ref_h2d_gb']):>8s} {r['agreement']:6.2f}{flag}")
    slower = [r for r in rows if r["slower"]]
    ratios = [r["forward_ratio"] for r in rows]
    print(f"{len(rows)} cells in both; a forward {min(ratios):.3f}-{max(ratios):.3f} x REF's; "
          f"{len(rows) - len(slower)} within {args.tolerance} x, {len(slower)} above it "
          f"({sum(r['same_bytes'] for r in slower)} of those with the same bytes); "
          f"agreement below 1 in {sum(r['agreement'] < 1 for r in rows)} cells")
    explained = [r for r in rows if r["read_delta_ms"] is not None]
    if explained and any(r["read_delta_ms"] for r in explained):
        x = np.array([r["read_delta_ms"] for r in explained])
        y = np.array([r["delta_ms"] for r in explained])
        slope, intercept = np.polyfit(x, y, 1)
        print(f"the reads' difference alone predicts each cell's change a forward: observed = {slope:.3f} x predicted "
              f"{intercept:+.3f} ms, correlation {np.corrcoef(x, y)[0, 1]:.3f} over {len(explained)} cells")
    goal = targets(new, new_bound, args.budget)
    if goal is None:
        print(f"targets: NEW has no oled cell at {args.budget} or no full cell at 1.0")
    else:
        print(f"targets at {args.budget} (NEW): oled {goal['oled_tpot_ms']:.3f} ms per token = "
              f"{goal['tpot_over_full']:.3f} x full's {goal['full_tpot_ms']:.3f} (target <= "
              f"{TARGETS['tpot_over_full']})")
        if "best_baseline" in goal:
            print(f"  best baseline {goal['best_baseline']} {goal['best_baseline_tpot_ms']:.3f} = "
                  f"{goal['best_baseline_over_oled']:.3f} x oled's (target >= {TARGETS['best_baseline_over_oled']})")
        print_against_bounds(goal["against_bounds"], args.budget)
    if args.json:
        Path(args.json).write_text(json.dumps({"cells": rows, "targets": goal}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
