"""`oled trace`: record routing, token states and confidences per iteration and layer; print the trace's statistics
against the real model's and its locality report.

  oled trace --random-weights tiny --workload code --out /tmp/t.trace
  oled trace --model DIR --workload chat --prompts 4 --gen-length 256 --out chat.trace --json locality.json
  oled trace --report chat.trace            (the statistics and the locality report of an existing trace)
  oled trace --report --markdown A.trace B.trace   (the statistics of several traces as one Markdown table)
  oled trace --report chat.trace --coverage|--ahead|--bursts|--forced   (replay sub-reports, JSON lines)
  oled trace --runner-ups 1,2,4,8 --workload code --prompts 2   (the routers' runner-ups as a prediction)
  oled bench --replay chat.trace --policies lru,prefetch,tide --budgets 0.5,0.25   (hit rates without a GPU)
"""
from __future__ import annotations

import json
import sys

from ..bench.runner import parse_list
from ..bench.workloads import Prompt, Workload, load
from ..engine import Engine
from ..policies.retention_model import fit as fit_retention
from ..policies.reuse import calibrate
from ..trace import Trace, format_locality, locality, record_trace, replay
from ..trace.predictor import format_predictor_report, predictor_report
from ..trace.realism import format_realism, markdown_table, realism
from ..trace.reports import BURST_STEPS, SUBREPORTS, WINDOWS, ReportOptions, run_subreport, unused_options
from ..trace.runner_ups import coverage, record_with_runner_ups
from ..trace.selection import expert_bytes, replay_costs
from .common import add_decode_args, add_engine_args, decode_params, engine_config

PREDICTOR_BUDGETS = "0.6,0.4,0.25"


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="record routing and confidence per iteration; report locality",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", metavar="FILE", help="trace file to write")
    p.add_argument("--report", metavar="TRACE", nargs="+",
                   help="only report on existing traces: the statistics against the real model and the locality "
                        "report (several traces: each in turn, or one table with --markdown)")
    p.add_argument("--markdown", action="store_true",
                   help="with --report: the statistics of every trace given as one Markdown table, beside the "
                        "published figures (benchmarks/traces/README.md)")
    p.add_argument("--workload", default="code",
                   help="code, math, chat, long, synthetic:LEN[:N] or a .jsonl file (default: code)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt instead of a workload (repeatable)")
    p.add_argument("--prompts", type=int, metavar="N", help="use at most N prompts of the workload (default: all)")
    p.add_argument("--no-predictions", dest="predictions", action="store_false",
                   help="do not record the next layer's predicted routing (replaying `prefetch` then uses the "
                        "actual routing of the next layer as its prediction)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--first", type=int, metavar="N",
                   help="with --report TRACE: only its first N requests (and with --out FILE: write their trace)")
    sub = p.add_argument_group("replay sub-reports of --report TRACE (JSON lines; --json FILE: a list)")
    one = sub.add_mutually_exclusive_group()
    for s in SUBREPORTS.values():
        chosen = f"budgets {s.budgets}" + (f" and policies {s.policies}" if s.policies else "")
        one.add_argument(f"--{s.name}", dest="subreport", action="store_const", const=s.name,
                         help=f"{s.help}; {chosen} unless given")
    sub.add_argument("--policies", help="comma list of policies to replay (default: the sub-report's)")
    sub.add_argument("--expert-mib", type=float, help="expert size the bytes are counted at (default: the trace's)")
    sub.add_argument("--windows", help=f"--ahead: comma list of W for recent:W (default: {WINDOWS})")
    sub.add_argument("--burst-steps", type=int, metavar="N",
                     help=f"--bursts: block steps shown one by one, later ones grouped (default: {BURST_STEPS})")
    p.add_argument("--runner-ups", metavar="M,...",
                   help="record with the model's own router and report, for each m, how many of a layer's next "
                        "new experts its router ranked k+1 .. k+m (JSON lines; --out FILE keeps the trace)")
    p.add_argument("--predictor", action="store_true",
                   help="the reuse predictor's report instead of the locality report: AUC of OLED's scores for the "
                        "next iteration's experts, retained sets of oled, lru, lfu, tide and belady per budget")
    p.add_argument("--budgets", help=f"--predictor and the sub-reports: budgets to replay (default: "
                                     f"{PREDICTOR_BUDGETS} for --predictor, else the sub-report's)")
    p.add_argument("--cost-model", metavar="FILE",
                   help="--predictor, --coverage, --bursts: a cost model's JSON or an `oled bench` results.jsonl "
                        "carrying one, for the policies that plan on it (default: the trace's, if any)")
    p.add_argument("--calibrate-reuse", metavar="FILE",
                   help="measure the reuse probabilities OLED's predictor uses on this trace and write them (JSON, "
                        "for --policy oled:calibration=FILE)")
    p.add_argument("--fit-retention", metavar="FILE",
                   help="fit OLED's learned retention score on the --report traces (least squares of how soon each "
                        "expert is used again on its layer's routing history) and write it (JSON, for --policy "
                        "oled:retention=learned,retention_model=FILE)")
    add_engine_args(p)
    add_decode_args(p)
    p.set_defaults(gen_length=64)


def run(args) -> int:
    _check(args)
    if args.runner_ups:
        return _runner_ups(args)
    if not args.report:
        reports = [_reports(_record(args), args)]
    else:
        traces = [Trace.load(path) for path in args.report]
        if args.fit_retention:
            model = fit_retention(traces, [str(path) for path in args.report])
            with open(args.fit_retention, "w") as f:
                f.write(model.to_json() + "\n")
            print(f"wrote {args.fit_retention} ({model.provenance['samples']} samples)", file=sys.stderr)
            return 0
        if args.first is not None:
            traces = [traces[0].first_requests(args.first)]
            if args.out:
                path = traces[0].save(args.out)
                print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB): {traces[0].describe()}", file=sys.stderr)
        if args.markdown:
            reports = [realism(trace) for trace in traces]
            print(markdown_table(list(zip(args.report, reports))))
        else:
            reports = [_reports(trace, args) for trace in traces]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports[0] if len(reports) == 1 else reports, f, indent=1)
    return 0


def _check(args) -> None:
    """Usage errors, before any trace is read or model loaded."""
    several = args.report is not None and len(args.report) > 1
    if args.report is None and (args.first is not None or args.markdown or args.subreport or args.fit_retention):
        raise ValueError("--first, --markdown, --fit-retention and the sub-reports read an existing trace: give "
                         "--report TRACE")
    if args.fit_retention and (args.first is not None or args.markdown or args.subreport or args.predictor
                               or args.out or args.calibrate_reuse or args.json):
        raise ValueError("--fit-retention writes the model only: not with another report or output")
    if args.report is not None and args.runner_ups:
        raise ValueError("--runner-ups records with the model's own router: it takes no --report TRACE")
    if args.report is None and not args.runner_ups and not args.out:
        raise ValueError("give --out FILE (the trace to write) or --report TRACE")
    if several and (args.first is not None or args.out or args.predictor or args.subreport or args.calibrate_reuse):
        raise ValueError("--first, --out, --predictor, --calibrate-reuse and the sub-reports take one trace")
    if args.markdown and (args.predictor or args.subreport):
        raise ValueError("--markdown prints the statistics table: not with --predictor or a sub-report")
    if args.subreport and args.predictor:
        raise ValueError(f"give --predictor or --{args.subreport}, not both")
    if args.subreport:
        unused = unused_options(SUBREPORTS[args.subreport], vars(args))
        if unused:
            raise ValueError(f"--{args.subreport} does not use --{unused[0].replace('_', '-')}")
    elif any(getattr(args, name) is not None for name in ("policies", "expert_mib", "windows", "burst_steps")):
        raise ValueError("--policies, --expert-mib, --windows and --burst-steps are options of the replay sub-reports")
    if args.burst_steps is not None and args.burst_steps < 1:
        raise ValueError("--burst-steps: at least 1")
    if args.windows is not None and not all(w > 0 for w in _ints(args.windows)):
        raise ValueError("--windows: a comma list of positive iteration counts")
    if args.runner_ups is not None and not all(m > 0 for m in _ints(args.runner_ups)):
        raise ValueError("--runner-ups: a comma list of positive ranks")


def _ints(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",")})
    except ValueError:
        raise ValueError(f"not a comma list of integers: {text!r}") from None
    return values


def _reports(trace, args):
    """The report --report (or a recording) prints for one trace; returned for --json."""
    if args.calibrate_reuse:
        with open(args.calibrate_reuse, "w") as f:
            f.write(calibrate([trace]).to_json())
        print(f"wrote {args.calibrate_reuse}", file=sys.stderr)
    if args.subreport:
        opts = ReportOptions(capture_slots=args.capture_slots, costs=replay_costs(args.cost_model),
                             expert_bytes=expert_bytes(args.expert_mib, int(trace.header["model"]["expert_bytes"])),
                             **({"windows": tuple(_ints(args.windows))} if args.windows else {}),
                             **({"steps": args.burst_steps} if args.burst_steps else {}))
        sub = SUBREPORTS[args.subreport]
        rows = []
        for row in run_subreport(sub, trace, parse_list(args.budgets or sub.budgets),
                                 parse_list(args.policies) if args.policies else None, opts):
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    if args.predictor:
        rep = predictor_report(trace, parse_list(args.budgets or PREDICTOR_BUDGETS), replay_costs(args.cost_model))
        print(format_predictor_report(rep))
        return rep
    stats = realism(trace)
    rep = locality(trace)
    print(format_realism(stats) + "\n\n" + format_locality(rep))
    return dict(rep, statistics=stats)


def _runner_ups(args) -> int:
    """--runner-ups: record with the wider routing and print a row per m."""
    runner_ups = _ints(args.runner_ups)
    engine, workload, prompts, params, progress = _recording(args)
    trace, wide = record_with_runner_ups(engine, prompts, params, max(runner_ups), workload=workload.describe(),
                                         on_prompt=progress)
    engine.manager.close()
    if args.out:
        path = trace.save(args.out)
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)
    rows = [{"model": trace.header["model"].get("name"), **row} for row in coverage(trace, wide, runner_ups)]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _recording(args):
    """The engine, workload, prompts [(id, ids)], decoding settings and progress printer of a recording."""
    params = decode_params(args)
    params.validate()                       # before the model is built
    engine = Engine(engine_config(args), progress=True)
    if args.prompt:
        workload = Workload("prompts", "command line", [Prompt(f"prompt-{i:02d}", prompt=t)
                                                        for i, t in enumerate(args.prompt)],
                            {"provenance": "given on the command line"})
    else:
        workload = load(args.workload, engine.tokenizer, args.prompts)
    prompts = [(p.id, p.ids(engine.tokenizer)) for p in workload.prompts]
    n = len(prompts)

    def progress(pid, res):
        progress.i += 1
        print(f"[{progress.i}/{n}] {pid}: {len(res.token_ids)} tokens, {res.nfe} forwards", file=sys.stderr)
    progress.i = 0
    return engine, workload, prompts, params, progress


def _record(args):
    engine, workload, prompts, params, progress = _recording(args)
    cfg = engine.cfg
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
