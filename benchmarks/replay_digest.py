"""One digest per replayed run of every policy: the decisions a host-side change must leave as they are.

    python benchmarks/replay_digest.py TRACE COST_MODEL_RESULTS.jsonl [--requests 1] [--budgets 0.6,0.4,0.25]
        [--policies lru,...] [--out FILE]

Replays the trace's first requests (oled/trace/replay.py, the engine's own decisions, no weights) through each
policy at each budget on the three host paths: the host round trip, mapped misses, and mapped misses with the
default capture slots. Prints one line per run: a SHA-256 over every layer record's counters and routed experts and
over the final slot tables (so a change of which slot an expert took shows too), and the run's loads and hit rate.
Run it before and after a change to the host's bookkeeping (Residency, the policies, the predictor): equal digests
mean the same decisions, record for record.
"""
from __future__ import annotations

import argparse
import hashlib
import json

from oled.config import EngineConfig
from oled.kernels.triton_moe import mapped_rows
from oled.runtime.cost_model import CostModel
from oled.runtime.stats import COUNTERS
from oled.trace import Trace, replay

POLICIES = ("lru", "lfu", "tide", "belady", "oled", "oled-retain", "oled-coop", "lru:misses=cooperative")


def digest(mgr, counters=COUNTERS) -> str:
    h = hashlib.sha256()
    for r in mgr.stats.records:
        row = [r.forward, r.kind, r.layer, *(getattr(r, c) for c in counters), sorted(r.expert_tokens.items())]
        h.update(json.dumps(row).encode())
    h.update(mgr.residency.cache.table.tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("results", help="a bench run's results file: its cost model plans the cooperative policies")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--budgets", default="0.6,0.4,0.25")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", help="also write the lines here")
    ap.add_argument("--without-counters", default="",
                    help="counters left out of the digest (comma-separated): those a commit compared with lacks")
    args = ap.parse_args(argv)
    left_out = set(filter(None, args.without_counters.split(",")))
    if left_out - set(COUNTERS):
        ap.error(f"--without-counters: no such counter {sorted(left_out - set(COUNTERS))}; counters: {COUNTERS}")
    counters = tuple(c for c in COUNTERS if c not in left_out)
    costs = CostModel.from_file(args.results)
    trace = Trace.load(args.trace).first_requests(args.requests)
    capture = EngineConfig.capture_slots
    paths = {"round-trip": (0, 0), "mapped": (mapped_rows(True), 0), f"mapped+capture{capture}":
             (mapped_rows(True), capture)}
    lines = []
    for spec in args.policies.split(","):
        name, *opts = spec.split(":")
        options = dict(opt.split("=", 1) for opt in opts)
        for budget in args.budgets.split(","):
            for path, (rows, slots) in paths.items():
                mgr = replay(trace, name, budget, costs, mapped_rows=rows, capture_slots=slots, cpu_share=False,
                             **options)
                recs = [r for r in mgr.stats.records if r.kind == "iteration"]
                hit = sum(r.pairs_hit for r in recs) / max(sum(r.pairs for r in recs), 1)
                lines.append(f"{spec:24s} {budget:>5s} {path:17s} {digest(mgr, counters)}  "
                             f"loads {sum(r.loads for r in recs):6d}  token hit rate {hit:.4f}")
                print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
