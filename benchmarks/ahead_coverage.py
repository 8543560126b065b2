"""How far copying the next iteration's misses during the current one could go, replayed from a trace on the CPU.
On the mapped path an iteration's misses are read from host memory inside its MoE layers, in series with their
compute; whatever the host could name one iteration ahead could instead be copied into slots while the current
forward runs (a forward of `full` leaves the copy engine room for about 0.15 GB on the H200, BENCHMARKS.md section
27). Per (policy, budget) and per prediction, over the mapped iterations: the misses, the share of them the
prediction names, the experts it names that are not resident (what a prefetch would copy) and the share of those
the layer then does not need, and both in GB per iteration at --expert-mib. The predictions use only what the host
knows after an iteration:
  recent:W  the experts the layer used in the W iterations before, that are not resident now;
  block     at a block's first iteration only: the experts the layer used at the previous block's first iteration;
  both      their union (recent at the widest W given).
Counts only, no timing.

    python benchmarks/ahead_coverage.py benchmarks/traces/proxy-chat.trace --requests 1 --expert-mib 6 \
        --budgets 0.6,0.4,0.25 --policies oled-retain --windows 1,2,4,8
"""
from __future__ import annotations

import argparse
import json
from collections import deque

from oled.kernels.triton_moe import mapped_rows
from oled.trace import Trace, selection
from oled.trace.replay import replay_manager


def coverage(trace: Trace, policy: str, budget: str, capture_slots: int, windows: list[int],
             expert_bytes: int) -> list[dict]:
    """One replay; a result per prediction (recent:W for each window, block, both)."""
    mgr = replay_manager(trace, policy, budget, mapped_rows=mapped_rows(True), capture_slots=capture_slots)
    widest = max(windows)
    names = [f"recent:{w}" for w in windows] + ["block", "both"]
    counts = {name: {"named": 0, "fetched": 0, "wasted": 0} for name in names}
    totals = {"misses": 0, "layer_iterations": 0}
    history: dict[int, deque] = {}          # layer -> the experts of its last iterations, newest last
    first_of_block: dict[int, set] = {}     # layer -> the experts of the last block's first iteration
    current = {"forward": -1, "block_start": None, "request": None, "first": False}
    iterations = set()

    def before_mapped(run: int, layer: int, ids) -> None:
        forward = int(trace.run_forward[run])
        if forward != current["forward"]:
            info = trace.forward_info(forward)
            request = int(trace.fwd_request[forward])
            if request != current["request"]:
                history.clear()
                first_of_block.clear()
            current.update(forward=forward, request=request, first=info.block_start != current["block_start"],
                           block_start=info.block_start)
            iterations.add(forward)
        resident = mgr.cache.resident(layer).keys()
        need = set(ids.reshape(-1).tolist())
        misses = need - resident
        past = history.setdefault(layer, deque(maxlen=widest))
        named = {}
        for w in windows:
            named[f"recent:{w}"] = set().union(*list(past)[-w:]) if past else set()
        named["block"] = first_of_block.get(layer, set()) if current["first"] else set()
        named["both"] = named[f"recent:{widest}"] | named["block"]
        for name, experts in named.items():
            fetch = experts - resident
            c = counts[name]
            c["named"] += len(misses & fetch)
            c["fetched"] += len(fetch)
            c["wasted"] += len(fetch - need)
        totals["misses"] += len(misses)
        totals["layer_iterations"] += 1
        past.append(need)
        if current["first"]:
            first_of_block[layer] = need

    mgr.replay(before_mapped)
    n_iter = max(len(iterations), 1)
    gb = expert_bytes / 1e9 / n_iter
    out = []
    for name in names:
        c = counts[name]
        out.append({"policy": policy, "budget": budget, "capture_slots": capture_slots, "prediction": name,
                    "iterations": len(iterations), "misses_per_iteration": totals["misses"] / n_iter,
                    "miss_gb_per_iteration": totals["misses"] * gb,
                    "named_fraction": c["named"] / max(totals["misses"], 1),
                    "fetched_per_iteration": c["fetched"] / n_iter, "fetched_gb_per_iteration": c["fetched"] * gb,
                    "wasted_fraction": c["wasted"] / max(c["fetched"], 1)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    selection.add_replay_args(ap, policies="oled-retain", costs=False)
    ap.add_argument("--windows", default="1,2,4,8", help="comma list of W for recent:W (iterations looked back)")
    args = ap.parse_args(argv)
    trace = selection.selected_trace(args.trace, args.requests)
    windows = sorted({int(w) for w in args.windows.split(",")})
    if not windows or windows[0] < 1:
        ap.error("--windows: positive iteration counts")
    size = selection.expert_bytes(args.expert_mib, int(trace.header["model"]["expert_bytes"]))
    for budget in args.budgets.split(","):
        for policy in args.policies.split(","):
            for row in coverage(trace, policy, budget, args.capture_slots, windows, size):
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
