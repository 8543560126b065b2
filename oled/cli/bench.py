"""`oled bench`: policies x budgets x workloads side by side; JSON Lines, a Markdown report and plots.

  oled bench --random-weights tiny --policies full,lru,lfu --budgets 1.0,0.5,0.25 --workload code --out /tmp/b
  oled bench --model DIR --policies full,lru,prefetch,fiddler,tide:tau=4 --budgets 1.0,0.6,0.4,0.25 \\
             --workload code,math,chat,long --repeats 3 --out results/h200
  oled bench --replay run.trace --policies lru,lfu,prefetch,tide --budgets 0.5,0.25 --out /tmp/replay
  oled bench --routing proxy.trace --random-weights llada2-mini --policies full,lru,oled --out /tmp/routed
  oled bench --render results/h200          (re-render the report and plots from results.jsonl)
"""
from __future__ import annotations

import sys

from ..bench import BenchConfig, render, run_bench
from ..bench.runner import parse_list
from ..policies import POLICIES
from ..runtime.budget import parse_spec
from .common import TIDE_TAU, add_decode_args, add_engine_args, add_settings, decode_params, engine_config

# the engine settings a grid sets per run (--policies, --budgets), and those of one answer only
BENCH_SKIP = ("model", "random_weights", "expert_budget", "policy", "misses", "waves", "torch_threads")
BENCH_HELP = {"random_weights": "random weights with a preset's shapes (default: none, the checkpoint of --model)",
              "seed": "random-weights and run seed",
              "tide_tau": f"tide: refresh period, or give tide:tau=N (default: {TIDE_TAU})",
              "popularity": "fiddler: popularity file (default: calibrated on each workload with the reference pass, "
                            "or from the trace when replaying)"}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark policies x budgets x workloads side by side",
                       description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("model (one of)")
    add_settings(src, ("model", "random_weights"), helps=BENCH_HELP)
    src.add_argument("--replay", metavar="TRACE", help="replay a trace from `oled trace` through the policies "
                                                       "(CPU simulation: hit rates, loads, CPU pairs; no timing; "
                                                       "all its requests unless --prompts N)")
    src.add_argument("--routing", metavar="TRACE",
                     help="run the model (e.g. --random-weights llada2-mini) with this trace's routing and commits "
                          "in place of its router's and decoder's: learned routing at the model's real expert sizes "
                          "(the trace's decoding settings and all its requests are used; --prompts N takes the "
                          "first N and the results say so)")
    src.add_argument("--render", metavar="DIR", help="only re-render DIR/report.md and plots from DIR/results.jsonl")
    g = p.add_argument_group("grid")
    g.add_argument("--policies", default="full,lru",
                   help=f"comma-separated policies ({', '.join(sorted(POLICIES))}); options as name:key=value "
                        "(tide:tau=2); `full` runs at 100%% only (default: full,lru)")
    g.add_argument("--budgets", default="1.0,0.6,0.4,0.25",
                   help="comma-separated expert budgets: fractions, percentages or sizes (default: 1.0,0.6,0.4,0.25)")
    g.add_argument("--workload", default="code",
                   help="comma-separated workloads: code, math, chat, long, synthetic:LEN[:N] or a .jsonl file")
    g.add_argument("--prompts", type=int, metavar="N",
                   help="use at most N prompts of each workload (--routing, --replay: default all the trace's "
                        "requests; fewer is a sample the results state)")
    g.add_argument("--repeats", type=int, default=3, help="timed passes per run (median and spread; default 3)")
    g.add_argument("--warmup", type=int, default=1, help="warm-up prompts per run, excluded (default 1)")
    g.add_argument("--out", default="oled-bench", help="output directory (default: oled-bench)")
    g.add_argument("--breakdown", metavar="POLICY@BUDGET",
                   help="run whose per-iteration time breakdown is plotted (default: the first non-full policy at "
                        "the smallest budget)")
    g.add_argument("--profile-all", action="store_true", help="profiled pass for every run (sections in every line)")
    g.add_argument("--no-profile", dest="profile", action="store_false", help="no profiled pass (no breakdown)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument("--no-bound", dest="bound", action="store_false",
                   help="no `belady` rows (the retention bound, replayed on the reference pass's or the trace's "
                        "routing at every budget)")
    add_engine_args(p, skip=BENCH_SKIP, helps=BENCH_HELP)
    e = p.add_argument_group("replay")
    e.add_argument("--cost-model", metavar="FILE",
                   help="replay: the cost model that cooperative policies plan on and the time bounds use: a JSON file "
                        "(as in a bench line's `cost_model` or ~/.cache/oled/costs/) or a grid's results.jsonl[.gz] "
                        "(default: the one recorded in the trace)")
    add_decode_args(p)


def run(args) -> int:
    if args.render:
        path = render(args.render, breakdown=args.breakdown)
        print(f"wrote {path}", file=sys.stderr)
        return 0
    if args.model and args.random_weights:
        raise ValueError("give --model or --random-weights, not both")
    if args.routing and args.replay:
        raise ValueError("give --routing (the model runs with the trace's routing) or --replay (no model), not both")
    budgets = parse_list(args.budgets)
    for spec in budgets:            # a typo is refused before any run, not skipped after the model is loaded
        parse_spec(spec)
    decode = decode_params(args)
    decode.validate()
    cfg = BenchConfig(policies=parse_list(args.policies), budgets=budgets, workloads=parse_list(args.workload),
                      out=args.out, engine=engine_config(args), decode=decode, prompts=args.prompts,
                      repeats=args.repeats, warmup=args.warmup, breakdown=args.breakdown, profile_all=args.profile_all,
                      profile=args.profile, replay=args.replay, routing=args.routing, cost_model=args.cost_model,
                      progress=args.progress, bound=args.bound)
    rows = run_bench(cfg)
    if not rows:
        print("no run completed (see the messages above)", file=sys.stderr)
        return 1
    print(f"{len(rows)} runs -> {args.out}/results.jsonl, report {args.out}/report.md, plots {args.out}/plots/",
          file=sys.stderr)
    return 0
