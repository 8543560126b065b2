"""PCIe traffic of the miss paths, replayed from a trace on the CPU: the host round trip (each miss copied once, or
computed on the CPU), mapped misses (read by the kernels, then copied if the policy keeps it), a hybrid that
replays each block's first forward on the host round trip (a block's first iterations miss the most; not built in
the engine), and mapped misses with capture at each of --capture-slots (a kept miss written into a free slot as it
is read: crosses once, but that many slots a layer stay empty). Bytes only, no timing: the PCIe time is bytes /
--gbps.

    python benchmarks/probes/mapped_traffic.py benchmarks/traces/proxy-chat.trace --budgets 0.6,0.4,0.25 --policies lru,oled \
        --costs benchmarks/results/h200/mapped-fd4a7cc/routing-grid/results.jsonl.gz

One line per (policy, budget, path): token hit rate, GB copied, GB read mapped, their sum and its time at --gbps, per
denoising iteration; CPU pairs per iteration (host round trip only) and experts captured (capture only). Bytes count
the trace's experts (a routing proxy's are 48 KiB, not LLaDA2.0-mini's 6 MiB: compare the paths' ratios), or experts
of --expert-mib (6 for LLaDA2.0-mini, as `oled bench --routing` replays them); --requests N replays the trace's first
N requests (`oled bench --prompts N`). A policy takes options as `oled bench` writes them (oled-retain:decay=0.5).
`belady` gives the bytes of the fewest misses any retention policy takes on each path. A policy that plans on costs
(oled, oled-coop, misses=cooperative) needs --costs: a cost model's JSON, or an `oled bench` results.jsonl whose first
line with a cost model gives it (the trace's own is used otherwise).
"""
from __future__ import annotations

import argparse
import json

from oled.bench.runner import PolicySpec
from oled.kernels.triton_moe import mapped_rows
from oled.runtime.cost_model import CostModel
from oled.runtime.residency import Residency
from oled.trace import Trace, selection
from oled.trace.replay import replay_manager

PATHS = ("host", "mapped", "hybrid")


class BlockStartOnHost:
    """Residency.takes_mapped_path, except that a block's first forward (a new block_start) takes the host round
    trip: set on one Residency for the hybrid replay."""

    def __init__(self, residency: Residency):
        self.mapped, self.last_block = residency.takes_mapped_path, None

    def __call__(self, info) -> bool:
        first = info.kind == "iteration" and info.block_start != self.last_block
        if info.kind == "iteration":
            self.last_block = info.block_start
        return self.mapped(info) and not first


def run(trace: Trace, policy: str, budget: str, path: str, gbps: float, costs: CostModel | None = None,
        capture_slots: int = 0, expert_bytes: int | None = None) -> dict:
    """One replay; path "capture" is the mapped path with capture_slots; expert_bytes rescales the bytes (None:
    the trace's experts)."""
    spec = PolicySpec.parse(policy)
    mgr = replay_manager(trace, spec.name, budget, costs, mapped_rows=mapped_rows(path != "host"),
                         capture_slots=capture_slots if path == "capture" else 0, **spec.options)
    if path == "hybrid":
        mgr.residency.takes_mapped_path = BlockStartOnHost(mgr.residency)
    mgr.replay()
    s = mgr.stats.summary()
    scale = 1.0 if expert_bytes is None else expert_bytes / trace.header["model"]["expert_bytes"]
    copied, mapped = s["h2d_gb_per_iteration"] * scale, s["mapped_gb_per_iteration"] * scale
    return {"policy": policy, "budget": budget, "path": path, "capture_slots": mgr.residency.capture_slots,
            "hit_rate_tokens": s["hit_rate_tokens"], "copied_gb": copied, "mapped_gb": mapped,
            "pcie_gb": copied + mapped, "pcie_ms": (copied + mapped) / gbps * 1e3,
            "cpu_pairs": s["cpu_pairs_per_iteration"], "captured": s["captured_experts_per_iteration"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--budgets", default="0.6,0.4,0.25")
    ap.add_argument("--policies", default="lru,oled")
    ap.add_argument("--gbps", type=float, default=55.0, help="pinned H2D bandwidth for the time column (GB/s)")
    ap.add_argument("--costs", help="cost model JSON, or an oled bench results.jsonl carrying one")
    ap.add_argument("--capture-slots", default="4", help="comma list: a capture path per value ('' for none)")
    selection.add_selection_args(ap)
    args = ap.parse_args(argv)
    trace, costs = selection.selected_trace(args.trace, args.requests), selection.replay_costs(args.costs)
    size = selection.expert_bytes(args.expert_mib, int(trace.header["model"]["expert_bytes"]))
    for policy in args.policies.split(","):
        for budget in args.budgets.split(","):
            for path in PATHS:
                print(json.dumps(run(trace, policy, budget, path, args.gbps, costs, expert_bytes=size)), flush=True)
            for slots in filter(None, args.capture_slots.split(",")):
                print(json.dumps(run(trace, policy, budget, "capture", args.gbps, costs, int(slots), size)),
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
