"""`oled trace`: record routing, token states and confidences per iteration and layer; print the locality report.

  oled trace --random-weights tiny --workload code --out /tmp/t.trace
  oled trace --model DIR --workload chat --prompts 4 --gen-length 256 --out chat.trace --json locality.json
  oled trace --report chat.trace            (the locality report of an existing trace)
  oled bench --replay chat.trace --policies lru,prefetch,tide --budgets 0.5,0.25   (hit rates without a GPU)
"""
from __future__ import annotations

import json
import sys

from .common import add_decode_args, add_engine_args, decode_params, engine_config


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="record routing and confidence per iteration; report locality",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", metavar="FILE", help="trace file to write")
    p.add_argument("--report", metavar="TRACE", help="only print the locality report of an existing trace")
    p.add_argument("--workload", default="code",
                   help="code, math, chat, long, synthetic:LEN[:N] or a .jsonl file (default: code)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt instead of a workload (repeatable)")
    p.add_argument("--prompts", type=int, metavar="N", help="use at most N prompts of the workload")
    p.add_argument("--no-predictions", dest="predictions", action="store_false",
                   help="do not record the next layer's predicted routing (replaying `prefetch` then uses the "
                        "actual routing of the next layer as its prediction)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--first", type=int, metavar="N",
                   help="with --report TRACE and --out FILE: write the trace of TRACE's first N requests to FILE")
    p.add_argument("--predictor", action="store_true",
                   help="the reuse predictor's report instead of the locality report: AUC of OLED's scores for the "
                        "next iteration's experts, retained sets of oled, lru, lfu, tide and belady per budget")
    p.add_argument("--budgets", default="0.6,0.4,0.25", help="--predictor: budgets to replay (default: %(default)s)")
    p.add_argument("--cost-model", metavar="FILE",
                   help="--predictor: cost model JSON for the cooperative `oled` (default: the trace's, if any)")
    p.add_argument("--calibrate-reuse", metavar="FILE",
                   help="measure the reuse probabilities OLED's predictor uses on this trace and write them (JSON, "
                        "for --policy oled:calibration=FILE)")
    add_engine_args(p)
    add_decode_args(p)
    p.set_defaults(gen_length=64)


def run(args) -> int:
    from ..trace import Trace, format_locality, locality

    if args.report:
        trace = Trace.load(args.report)
        if args.first is not None:
            if not args.out:
                raise ValueError("--first N writes a smaller trace: give --out FILE")
            trace = trace.first_requests(args.first)
            path = trace.save(args.out)
            print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB): {trace.describe()}", file=sys.stderr)
    else:
        if args.first is not None:
            raise ValueError("--first N takes the trace to shorten from --report TRACE")
        if not args.out:
            raise ValueError("give --out FILE (the trace to write) or --report TRACE")
        trace = _record(args)
    if args.calibrate_reuse:
        from ..policies.reuse import calibrate
        with open(args.calibrate_reuse, "w") as f:
            f.write(calibrate([trace]).to_json())
        print(f"wrote {args.calibrate_reuse}", file=sys.stderr)
    if args.predictor:
        from ..bench.runner import parse_list
        from ..runtime.cost_model import CostModel
        from ..trace.predictor import format_predictor_report, predictor_report
        costs = CostModel.from_json(open(args.cost_model).read()) if args.cost_model else None
        rep = predictor_report(trace, parse_list(args.budgets), costs)
        print(format_predictor_report(rep))
    else:
        rep = locality(trace)
        print(format_locality(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


def _record(args):
    from ..bench.workloads import Prompt, Workload, load
    from ..engine import Engine
    from ..trace import record_trace, replay

    cfg = engine_config(args)
    engine = Engine(cfg, progress=True)
    if args.prompt:
        workload = Workload("prompts", "command line", [Prompt(f"prompt-{i:02d}", prompt=t)
                                                        for i, t in enumerate(args.prompt)],
                            {"provenance": "given on the command line"})
    else:
        workload = load(args.workload, engine.tokenizer, args.prompts)
    params = decode_params(args)
    prompts = [(p.id, p.ids(engine.tokenizer)) for p in workload.prompts]
    n = len(prompts)

    def progress(pid, res):
        progress.i += 1
        print(f"[{progress.i}/{n}] {pid}: {len(res.token_ids)} tokens, {res.nfe} forwards", file=sys.stderr)
    progress.i = 0

    trace, _ = record_trace(engine, prompts, params, workload=workload.describe(), predictions=args.predictions,
                            on_prompt=progress)
    path = trace.save(args.out)
    engine.manager.close()
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)
    # Self-check: replaying the trace through the recording policy and budget gives the live run's statistics.
    live = trace.header["live"]
    options = {"tau": cfg.tide_tau, "popularity": cfg.popularity, "misses": live.get("misses")}
    try:
        rep = replay(trace, live["policy"], live["expert_budget"], **options)
        same = rep.stats.summary(kinds=("prefill", "iteration", "cache_fill")).get("totals", {}) == live["totals"]
        print(f"replay check ({live['policy']}, {live['slots_per_layer']} slots per layer): "
              f"{'same hit, load and CPU counts as the live run' if same else 'DIFFERS from the live run'}",
              file=sys.stderr)
    except (ValueError, RuntimeError) as e:
        print(f"replay check skipped: {e}", file=sys.stderr)
    print("", file=sys.stderr)
    return trace
