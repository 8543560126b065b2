"""What computing part of each layer's misses on the CPU inside a mapped forward could save, estimated on the CPU from a
trace and a measured cost model (not built: a mapped forward computes every miss on the GPU from host memory).

A replay of POLICY at each budget on the mapped path (16 capture slots, as the engine) gives every layer's misses and
their tokens. Per layer, two times from the planner's objective (oled/runtime/planner.py `plan_cost`, the cost model
of an H200 run with its load time replaced by the mapped reads' rate, --gbps):
  mapped  every miss read from host memory by the GPU kernels: read time + GPU time per expert;
  split   the planner's best split (`split_misses`) between those reads and the CPU kernel (its per-call time, its
          time per expert by tokens, its slowdown beside PCIe traffic and the activations' transfer), the layer
          taking the longer side.
Summed per denoising iteration, in ms, with the CPU experts and pairs the split would send. The estimate assumes a
mapped forward could hand a layer's routing and input rows to the CPU and wait for its results without more cost than
the cost model's transfer term; how the GPU would wait for them is exactly what is not built.

    python benchmarks/probes/coop_mapped_estimate.py benchmarks/traces/proxy-chat.trace \
        benchmarks/results/h200/s29/call3/routing-grid/results.jsonl.gz --requests 1 --expert-mib 6 --gbps 47 \
        --budgets 0.6,0.4,0.25
"""
from __future__ import annotations

import argparse
import json

from oled.config import EngineConfig
from oled.kernels.triton_moe import mapped_rows
from oled.runtime.cost_model import CostModel
from oled.runtime.planner import PlanInputs, plan_cost, split_misses
from oled.trace import Trace, selection
from oled.trace.replay import replay_manager


def mapped_read_costs(costs: CostModel, gbps: float, expert_bytes: int) -> CostModel:
    """The cost model with its load time per expert that of a read from host memory at `gbps` (experts of
    expert_bytes): the mapped path's miss, where the measured model's load is a copy."""
    d = costs.to_dict()
    d["h2d_gbps"], d["expert_bytes"] = gbps, expert_bytes
    return CostModel.from_dict(d)


def estimate(trace: Trace, policy: str, budget: str, costs: CostModel,
             capture_slots: int = EngineConfig.capture_slots) -> dict:
    mgr = replay_manager(trace, policy, budget, mapped_rows=mapped_rows(True), capture_slots=capture_slots)
    totals = {"mapped_s": 0.0, "split_s": 0.0, "cpu_experts": 0, "cpu_pairs": 0, "layers_with_misses": 0}
    forwards = set()

    def before_mapped(run: int, layer: int, ids) -> None:
        forwards.add(int(trace.run_forward[run]))
        resident = mgr.cache.resident(layer).keys()
        flat = ids.reshape(-1).tolist()
        tokens: dict[int, int] = {}
        for e in flat:
            if e not in resident:
                tokens[e] = tokens.get(e, 0) + 1
        if not tokens:
            return
        inputs = PlanInputs(tokens=tokens, rows=len(ids))
        load, cpu = split_misses(inputs, costs)
        totals["mapped_s"] += plan_cost(list(tokens), [], inputs, costs)
        totals["split_s"] += plan_cost(load, cpu, inputs, costs)
        totals["cpu_experts"] += len(cpu)
        totals["cpu_pairs"] += sum(tokens[e] for e in cpu)
        totals["layers_with_misses"] += 1

    mgr.replay(before_mapped)
    n = max(len(forwards), 1)
    return {"policy": policy, "budget": budget, "iterations": len(forwards),
            "mapped_ms_per_iteration": totals["mapped_s"] / n * 1e3,
            "split_ms_per_iteration": totals["split_s"] / n * 1e3,
            "saved_ms_per_iteration": (totals["mapped_s"] - totals["split_s"]) / n * 1e3,
            "cpu_experts_per_iteration": totals["cpu_experts"] / n, "cpu_pairs_per_iteration": totals["cpu_pairs"] / n,
            "layers_with_misses_per_iteration": totals["layers_with_misses"] / n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("costs", help="a cost model's JSON or an `oled bench` results.jsonl carrying one (an H200 run's)")
    ap.add_argument("--budgets", default="0.6,0.4,0.25")
    ap.add_argument("--policy", default="oled-retain")
    ap.add_argument("--gbps", type=float, default=47.0, help="the mapped reads' rate (GB/s)")
    ap.add_argument("--capture-slots", type=int, default=EngineConfig.capture_slots)
    selection.add_selection_args(ap, size_default="the cost model's")
    args = ap.parse_args(argv)
    trace = selection.selected_trace(args.trace, args.requests)
    measured = CostModel.from_file(args.costs)
    size = selection.expert_bytes(args.expert_mib, measured.expert_bytes)
    costs = mapped_read_costs(measured, args.gbps, size)
    for budget in args.budgets.split(","):
        print(json.dumps(estimate(trace, args.policy, budget, costs, args.capture_slots)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
