"""Does one expert pool for all MoE layers, divided online, make fewer misses than the even split on a trace?

Belady's misses fall with one shared pool (`bound:belady-shared` against `-even`), but belady knows the future. This
replays a trace's layer runs through least-recently-used retention under three divisions of the same slots:
  even      each layer its budget's share, as the runtime splits it
  ucp       one pool whose per-layer shares are recomputed at every block from the layers' LRU miss curves (Mattson
            stack distances, decayed by half a block), the slots going in order of hits per slot along each curve's
            upper concave hull (utility-based partitioning, Qureshi and Patt's lookahead), each layer keeping at least
            its FLOOR: the experts its last timed run needed (`last`) or their mean over the block (`mean`)
  global    one pool, evicting the resident (of any layer, not needed by the run) with the most runs of its own layer
            since its last use (recency measured per layer, so the layers' cyclic order does not decide)
and belady's fewest misses with each budget split evenly and as one pool (oled/bounds.py).
Misses: experts a timed run (a denoising iteration) needs that are not resident, per iteration, as the grids count.

    python3 benchmarks/probes/shared_pool_probe.py benchmarks/traces/proxy-chat.trace --budgets 0.6,0.4,0.25
"""
from __future__ import annotations

import argparse

import numpy as np

from oled.bounds import Demand, belady
from oled.runtime.budget import parse_budget
from oled.trace import Trace

DECAY = 0.5


def hull_segments(curve: np.ndarray) -> list[tuple[float, int]]:
    """(slope, length) segments of the upper concave hull of (n, curve[n]) from n = 0 (Andrew's monotone chain)."""
    hull: list[int] = []
    for n in range(len(curve)):
        while len(hull) >= 2 and ((curve[hull[-1]] - curve[hull[-2]]) * (n - hull[-2])
                                  <= (curve[n] - curve[hull[-2]]) * (hull[-1] - hull[-2])):
            hull.pop()
        hull.append(n)
    return [((curve[b] - curve[a]) / (b - a), b - a) for a, b in zip(hull, hull[1:])]


def ucp_shares(hits: np.ndarray, floor: np.ndarray, total: int, cap: int) -> np.ndarray | None:
    share = np.minimum(np.maximum(floor, 1), cap).astype(np.int64)
    if share.sum() > total:
        return None
    cum = np.concatenate((np.zeros((len(share), 1)), np.cumsum(hits, axis=1)), axis=1)
    segments = sorted((-slope, i, n) for i in range(len(share)) for slope, n in hull_segments(cum[i, share[i]:]))
    left = total - int(share.sum())
    for neg, i, n in segments:
        if left <= 0 or neg >= 0:
            break
        take = min(n, left)
        share[i] += take
        left -= take
    while left > 0:                               # slots that add no hit: one each in turn
        room = np.nonzero(share < cap)[0]
        for i in room[:left]:
            share[i] += 1
        left -= min(len(room), left)
    return share


def replay(trace: Trace, demand: Demand, slots: int, division: str, floor_kind: str = "last") -> float:
    layers = demand.layers
    pos = {layer: i for i, layer in enumerate(layers)}
    L, E = len(layers), int(trace.header["model"]["num_experts"])
    total = slots * L
    share = np.full(L, slots)
    resident = np.zeros((L, E), dtype=bool)
    last = np.full((L, E), -1, dtype=np.int64)            # the run (of its own layer) of each expert's last use
    runs_of = np.zeros(L, dtype=np.int64)
    hits = np.zeros((L, E))                               # LRU stack-distance reuse counts (ucp)
    floor_last, floor_sum, floor_runs = np.ones(L), np.zeros(L), np.zeros(L)
    block, misses = None, 0
    for r, run in enumerate(demand.runs):
        f = int(trace.run_forward[r])
        key = (int(trace.fwd_request[f]), int(trace.fwd_block_start[f]))
        i = pos[run.layer]
        if division == "ucp" and key != block and i == 0:
            block = key
            floor = floor_last if floor_kind == "last" else np.round(floor_sum / np.maximum(floor_runs, 1))
            new = ucp_shares(hits, floor, total, E) if hits.any() else None
            if new is not None:
                share = new
                for j in range(L):                        # shrink: drop the least recently used
                    held = np.nonzero(resident[j])[0]
                    if len(held) > share[j]:
                        resident[j, held[np.argsort(last[j, held], kind="stable")[: len(held) - share[j]]]] = False
            hits *= DECAY
            floor_sum[:] = 0
            floor_runs[:] = 0
        need = run.experts
        if run.timed:
            misses += int((~resident[i, need]).sum())
            seen = last[i, need] >= 0
            if seen.any():
                ordered = np.sort(last[i])
                dist = E - np.searchsorted(ordered, last[i, need][seen], side="right")
                np.add.at(hits[i], np.minimum(dist, E - 1), 1.0)
            floor_last[i] = len(need)
            floor_sum[i] += len(need)
            floor_runs[i] += 1
        runs_of[i] += 1
        last[i, need] = runs_of[i]
        resident[i, need] = True
        if division == "global":
            over = int(resident.sum()) - total
            if over > 0:
                age = (runs_of[:, None] - last).astype(float)
                age[~resident] = -1.0
                age[i, need] = -1.0
                resident.reshape(-1)[np.argsort(-age, axis=None, kind="stable")[:over]] = False
        else:
            held = np.nonzero(resident[i])[0]
            if len(held) > share[i]:
                keep_first = np.lexsort((last[i, held],))[::-1]       # most recent first
                resident[i, held[keep_first[share[i]:]]] = False
    return misses / max(demand.iterations, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--budgets", default="0.6,0.4,0.25")
    args = p.parse_args(argv)
    trace = Trace.load(args.trace)
    demand = Demand.from_trace(trace)
    model = trace.header["model"]
    print("misses an iteration, least-recently-used retention")
    print(f"{'budget':>7s} {'even':>8s} {'ucp/last':>9s} {'ucp/mean':>9s} {'global':>8s}   belady: {'even':>6s} "
          f"{'shared':>6s}")
    for budget in args.budgets.split(","):
        slots = parse_budget(budget, num_layers=len(demand.layers), num_experts=model["num_experts"],
                             expert_bytes=model["expert_bytes"]).slots_per_layer
        row = [replay(trace, demand, slots, "even"), replay(trace, demand, slots, "ucp", "last"),
               replay(trace, demand, slots, "ucp", "mean"), replay(trace, demand, slots, "global")]
        bound = [belady(demand, slots).misses(demand), belady(demand, slots * len(demand.layers), "shared").misses(demand)]
        print(f"{budget:>7s} {row[0]:8.1f} {row[1]:9.1f} {row[2]:9.1f} {row[3]:8.1f}           "
              + " ".join(f"{m / max(demand.iterations, 1):6.2f}" for m in bound))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
