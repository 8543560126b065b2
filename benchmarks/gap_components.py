"""Where a policy's time above the bound goes, on a learned-routing grid: its misses, or how it serves them.

For every live policy row of a routing grid (`oled bench --routing TRACE`, its results.jsonl[.gz]) at the budgets
asked, the trace is replayed through the same policy at the same budget on the grid's measured cost model, giving
the policy's misses run by run. Those misses served as the bound serves them (over the link, inside their layer,
beside the layer's compute: oled/bounds.py, misses_seconds; each MoE layer's compute is full's measured forward split
evenly over the MoE layers, as the grid's bound rows take it) give the time its retention alone would cost. Then,
per generated token and per iteration:

    measured - bound(demand-link, POOL) = retention + service
    retention = own misses at the bound's service - bound(demand-link, POOL)     (more misses than belady's)
    service   = measured - own misses at the bound's service                      (reads not hidden under compute,
                                                                                   host decisions, CPU hand-over)

    python3 benchmarks/gap_components.py --trace benchmarks/traces/proxy-chat.trace \\
        --grid benchmarks/results/h200/s37/routing-merged/results.jsonl.gz --budgets 0.4 [--json FILE]
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from oled.bounds import CostTable, Demand, misses_seconds
from oled.policies.spec import PolicySpec
from oled.runtime.cost_model import CostModel
from oled.trace import Trace, replay

REFERENCE = "full"


def read_rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def median(row: dict, key: str):
    return (row["metrics"].get(key) or {}).get("median")


def components(trace: Trace, rows: list[dict], costs: CostModel, budgets: list[str], pool: str) -> list[dict]:
    demand = Demand.from_trace(trace)
    full = next((r for r in rows if r["policy"] == REFERENCE and r["mode"] == "live"), None)
    if full is None:
        raise ValueError(f"the grid has no live `{REFERENCE}` row: the layers' compute comes from its forward")
    forward_ms = median(full, "ms_per_forward")
    table = CostTable.from_cost_model(costs, forward_ms / 1e3 / len(demand.layers), demand.max_tokens,
                                      f"{costs.source}; compute: full's {forward_ms:.4g} ms a forward")
    per_token = 1e3 / max(demand.tokens, 1)
    iteration_per_token = max(demand.iterations, 1) / max(demand.tokens, 1)
    out = []
    for budget in budgets:
        bound = {r["policy"]: median(r, "tpot_ms") for r in rows if r["mode"] == "bound" and r["budget"] == budget}
        link_bound = bound.get(f"bound:demand-link-{pool}")
        if link_bound is None:
            raise ValueError(f"the grid has no bound:demand-link-{pool} row at {budget}")
        for r in rows:
            if r["mode"] != "live" or r["budget"] != budget or r["policy"] == REFERENCE:
                continue
            spec = PolicySpec.parse(r["policy_label"])
            options = dict(spec.options)
            if spec.name == "fiddler":          # its placement from the trace's routing, as the routing grid took it
                options.setdefault("popularity", trace.popularity())
            mgr = replay(trace, spec.name, budget, costs, **options)
            misses = [rec.experts - rec.experts_hit for rec in mgr.stats.records]
            own = misses_seconds(demand, misses, table) * per_token
            measured = median(r, "tpot_ms")
            timed = sum(m for m, run in zip(misses, demand.runs) if run.timed)
            out.append({
                "policy": r["policy_label"], "budget": budget, "measured_ms": measured,
                "misses_per_iteration": median(r, "misses_per_iteration"),
                "replayed_misses_per_iteration": timed / max(demand.iterations, 1),
                "own_misses_at_bound_ms": own, "bound_ms": link_bound,
                "retention_ms": own - link_bound, "service_ms": measured - own,
                "retention_ms_per_iteration": (own - link_bound) / iteration_per_token,
                "service_ms_per_iteration": (measured - own) / iteration_per_token})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, type=Path)
    p.add_argument("--grid", required=True, type=Path, help="the routing grid's results.jsonl[.gz]")
    p.add_argument("--budgets", default="0.4", help="comma-separated, as the grid writes them (default 0.4)")
    p.add_argument("--pool", default="shared", choices=("even", "shared"), help="the bound's pool (default shared)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    try:
        rows = read_rows(args.grid)
        out = components(Trace.load(args.trace), rows, CostModel.from_file(args.grid), args.budgets.split(","),
                         args.pool)
    except (OSError, ValueError) as e:
        print(f"gap_components: {e}", file=sys.stderr)
        return 2
    print(f"ms per token (per iteration in brackets); bound = bound:demand-link-{args.pool}")
    print(f"{'policy':24s} {'budget':>6s} {'measured':>9s} {'misses/it':>9s} {'own@bound':>9s} {'bound':>7s} "
          f"{'retention':>17s} {'service':>17s}")
    for o in out:
        print(f"{o['policy']:24s} {o['budget']:>6s} {o['measured_ms']:9.2f} {o['misses_per_iteration']:9.1f} "
              f"{o['own_misses_at_bound_ms']:9.2f} {o['bound_ms']:7.2f} "
              f"{o['retention_ms']:7.2f} ({o['retention_ms_per_iteration']:6.2f}) "
              f"{o['service_ms']:7.2f} ({o['service_ms_per_iteration']:6.2f})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
