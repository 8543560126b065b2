"""Where a denoising iteration's time goes on the GPU's timeline: the forward against the idle gap before the next (H200).

For each POLICY@BUDGET: one warm-up generate, then one with a CUDA event recorded on the compute stream as each
forward is handed to the model runner and another as the runner returns (the graph launched). Between a forward's
first event and its second lie its launch and its work; between its second and the next forward's first, everything
the stream runs or waits for in between: the prediction's kernels and read-back, the host's decisions and the loop's
bookkeeping while the GPU idles. Reports medians over the steady-state iterations (a block's first forward, which
also writes the previous block's K/V, is left out) in ms, and the host's time inside the runner call (the launch), so
that an offloaded path's extra time splits into a longer forward and a longer gap. With --profile, once every run is
timed (CUPTI stays attached after a torch.profiler session and slows every launch after it), one more generate per
run under torch.profiler from its first denoising iteration on (prefill left out): GPU kernel time, launches and the
kernels by GPU time per forward, so that a longer forward splits by kernel; and the GPU's idle time between one
activity (kernel or copy) and the next, summed per forward by the pair of names around it, so that idle time inside
a forward is pinned to what comes before and after it.

    python benchmarks/forward_gaps.py [--runs full@1.0,oled@0.4,lru:misses=cooperative@0.4] [--workload code --gen-length 256] [--profile]
        [--routing TRACE] [--model DIR|bundled] [--cpu-share] [--host-profile N] [--out FILE.json]

--routing TRACE decodes the trace's first request with its routing and commits replayed (as `oled bench --routing`,
oled/trace/source.py) on the preset's real-size experts: learned routing's misses, split the same way.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict

import torch


def host_profile(decode, top: int) -> str:
    """One generate under cProfile: its `top` costliest functions by their own time, as pstats prints them."""
    profiler = cProfile.Profile()
    profiler.enable()
    res = decode()
    torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return f"{res.nfe} forwards, decode {res.decode_s * 1e3:.1f} ms\n{out.getvalue()}"


def set_run(engine, run: str) -> None:
    """POLICY[:key=value...]@BUDGET, as `oled bench --policies` writes a policy (lru:misses=cooperative@0.4)."""
    from oled.bench import PolicySpec

    policy, budget = run.rsplit("@", 1)
    spec = PolicySpec.parse(policy)
    engine.set_runtime(spec.name, budget, **spec.options)


PER_FORWARD = ("token_ids", "forwards_ms", "gaps_ms", "steady")     # in the JSON file, not the printed line


def measure(engine, decode, label: str) -> dict:
    """decode(): one generate of the request (a GenerationResult)."""
    decode()                                                 # warm-up: graph captures
    torch.cuda.synchronize()
    runner = engine.runner
    inner = runner.forward
    marks: list[tuple] = []                                   # (start event, end event, host s, kind)

    # the host's side of the gap: when each forward was handed over, when the manager's last read-back wait of a
    # forward returned (the GPU has done the forward's last MoE layer then, its LM head is left) and when its
    # end_forward returned
    m = engine.manager
    host_marks: list[tuple[str, float]] = []
    # (owner, method, the mark's name): the read-back wait of either path, and the forward's end
    stamped = [(owner, "read_routing", "_read_routing") for owner in (m.round_trip, m.mapped_path) if owner is not None]
    stamped.append((m, "end_forward", "end_forward"))

    def timed(ids, start, kv, kv_end, rows, **kw):
        host_marks.append(("forward", time.perf_counter()))
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        t0 = time.perf_counter()
        out = inner(ids, start, kv, kv_end, rows, **kw)
        host = time.perf_counter() - t0
        end.record()
        marks.append((begin, end, host, rows is not None and (rows.start or 0) == 0))
        return out

    for owner, name, mark in stamped:
        def stamping(*a, _inner=getattr(owner, name), _name=mark, **k):
            out = _inner(*a, **k)
            host_marks.append((_name, time.perf_counter()))
            return out
        setattr(owner, name, stamping)

    # the host's time inside the steps of a mapped forward's decisions, summed over the generate
    # (arm_capture: each layer's arming after its decision, and inside _prepare_device the layers left, if any);
    # name -> (owner, method)
    mapped = m.mapped_path
    summed = {"_await_routing": (mapped, "await_routing"), "_copy": (m.slots, "copy"),
              "_prepare_device": (m.slots, "prepare"), "decide_mapped": (m.residency, "decide_mapped"),
              "arm_capture": (m.residency, "arm_capture"),
              # the CPU's share: its job submitted, then waited for
              "_start_share": (mapped, "start_share"), "_finish_share": (mapped, "finish_share")}
    summed = {name: (owner, method) for name, (owner, method) in summed.items() if owner is not None}
    host_sums = dict.fromkeys(summed, 0.0)
    for name, (owner, method) in summed.items():
        def summing(*a, _inner=getattr(owner, method), _name=name, **k):
            t = time.perf_counter()
            out = _inner(*a, **k)
            host_sums[_name] += time.perf_counter() - t
            return out
        setattr(owner, method, summing)

    runner.forward = timed
    try:
        res = decode()
        torch.cuda.synchronize()
    finally:
        del runner.forward                                   # the instance attributes shadowed the methods
        for owner, name, _ in stamped:
            delattr(owner, name)
        for owner, method in summed.values():
            delattr(owner, method)
    tails = host_tails(host_marks, [steady for *_, steady in marks])
    forward, gap, launch = [], [], []
    for (b, e, host, steady), nxt in zip(marks, marks[1:] + [None]):
        if not steady:                                        # prefill, cache fills: not an iteration
            continue
        forward.append(b.elapsed_time(e))
        launch.append(host * 1e3)
        if nxt is not None:
            gap.append(e.elapsed_time(nxt[0]))
    med = statistics.median
    return {"run": label, "nfe": res.nfe, "iterations_timed": len(forward), "tokens": len(res.token_ids),
            "token_ids": res.token_ids, "decode_ms_per_forward": res.decode_s / res.nfe * 1e3,
            "forward_ms": med(forward), "gap_ms": med(gap) if gap else None, "runner_call_host_ms": med(launch),
            "forward_ms_mean": statistics.fmean(forward), "gap_ms_mean": statistics.fmean(gap) if gap else None,
            "host_ms_per_forward": {name: total / res.nfe * 1e3 for name, total in host_sums.items()},
            # per steady forward in order, and every forward's steadiness (a block's first forward is not)
            "forwards_ms": [round(f, 4) for f in forward], "gaps_ms": [round(g, 4) for g in gap],
            "steady": [steady for *_, steady in marks],
            **tails}


def host_tails(host_marks, steady: list[bool]) -> dict:
    """Per steady forward, host ms from its last routing read-back's return to its end_forward's return (the
    decisions left once the GPU is past its last MoE layer) and from there to the next forward's hand-over (the
    loop's own work: the step's result read, the next forward prepared)."""
    after_readback, to_next = [], []
    forwards = [i for i, (name, _) in enumerate(host_marks) if name == "forward"]
    for n, (i, j) in enumerate(zip(forwards, forwards[1:])):
        if not steady[n]:
            continue
        window = host_marks[i + 1: j]
        reads = [t for name, t in window if name == "_read_routing"]
        ends = [t for name, t in window if name == "end_forward"]
        if ends:
            if reads and reads[-1] <= ends[-1]:
                after_readback.append((ends[-1] - reads[-1]) * 1e3)
            to_next.append((host_marks[j][1] - ends[-1]) * 1e3)
    med = statistics.median
    return {"host_after_last_readback_ms": med(after_readback) if after_readback else None,
            "host_end_forward_to_next_ms": med(to_next) if to_next else None}


def profile_decode(engine, decode, top: int = 20) -> dict:
    """One generate under torch.profiler, started as the first denoising iteration is handed to the runner: the
    kernels of the iterations (and of the cache fills between blocks), per forward."""
    from torch.profiler import ProfilerActivity, profile
    runner = engine.runner
    inner = runner.forward
    prof = profile(activities=[ProfilerActivity.CUDA])
    forwards = [0]                                          # forwards since the profiler started; 0: not yet

    def counted(ids, start, kv, kv_end, rows, **kw):
        if forwards[0] == 0 and rows is not None and (rows.start or 0) == 0:
            torch.cuda.synchronize()
            prof.start()
            forwards[0] = 1
        elif forwards[0]:
            forwards[0] += 1
        return inner(ids, start, kv, kv_end, rows, **kw)

    runner.forward = counted
    try:
        decode()
        torch.cuda.synchronize()
    finally:
        del runner.forward
        if forwards[0]:
            prof.stop()
    n = max(forwards[0], 1)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_name[e.name][0] += e.device_time
        by_name[e.name][1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"profiled_forwards": n, "idle_us_per_forward": idle_between(kernels, n, top),
            "timeline": timeline(kernels),
            "gpu_kernel_ms_per_forward": sum(e.device_time for e in kernels if "Memcpy" not in e.name) / n / 1e3,
            "memcpy_ms_per_forward": sum(e.device_time for e in kernels if "Memcpy" in e.name) / n / 1e3,
            "launches_per_forward": len(kernels) / n,
            "top_kernels_us_per_forward": [{"kernel": name[:90], "us": us / n, "launches": c / n}
                                           for name, (us, c) in ranked]}


def idle_between(activities, forwards: int, top: int) -> list[dict]:
    """The GPU's idle time (no activity on any stream) between consecutive activities, summed per forward by the
    names of the activity before and after each gap (gaps of 1 us or less left out: the profiler's own resolution),
    largest first. The gap between two forwards shows as the pair (last activity of a forward, first of the next)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in activities)
    idle = defaultdict(lambda: [0.0, 0])
    busy_until, last = None, None
    for start, end, name in spans:
        if busy_until is not None and start - busy_until > 1.0:
            pair = idle[last[:40], name[:40]]
            pair[0] += start - busy_until
            pair[1] += 1
        if busy_until is None or end >= busy_until:
            busy_until, last = end, name
    ranked = sorted(idle.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"before": a, "after": b, "us": us / forwards, "gaps": c / forwards} for (a, b), (us, c) in ranked]


def timeline(activities, limit: int = 1000) -> list[list]:
    """`limit` GPU activities (about two and a half forwards) from the profile's middle on, in order of start:
    [start us from the first, duration us, idle us before it (no activity on any stream), name], so that what
    the GPU waits for between and inside forwards reads in sequence."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in activities)
    if not spans:
        return []
    mid = (spans[0][0] + spans[-1][1]) / 2
    first = next(i for i, (start, _, _) in enumerate(spans) if start >= mid)
    busy_until = max(end for _, end, _ in spans[:first]) if first else spans[0][0]
    t0, out = spans[first][0], []
    for start, end, name in spans[first: first + limit]:
        out.append([round(start - t0, 1), round(end - start, 1), round(max(start - busy_until, 0.0), 1), name[:70]])
        busy_until = max(busy_until, end)
    return out


def replayed_request(engine, path: str):
    """decode() for --routing: the trace's first request with its routing and commits, checked against the trace at
    its end (TraceMismatch if the run left the recorded path)."""
    from oled.decoding.loop import generate
    from oled.trace import Trace
    from oled.trace.source import TraceSource

    source = TraceSource(Trace.load(path), engine.config, engine.device)
    engine.set_routing_source(source)
    params, prompt_ids = source.decode_params(), source.prompt_ids(0)
    params.validate()

    def decode():
        source.begin_request(0)
        res = generate(engine.runner, prompt_ids, params, timer=engine.timer, commits=source)
        source.end_request(res.token_ids)
        return res
    return decode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="full@1.0,oled@0.4")
    ap.add_argument("--preset", default="llada2-mini")
    ap.add_argument("--model", help="a checkpoint directory (\"bundled\": the bundled tiny model) instead of --preset")
    ap.add_argument("--cpu-share", action="store_true", help="EngineConfig.cpu_share on (the CPU's share of the "
                    "mapped forwards' misses)")
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--workload", default="code", help="decode the first prompt of this workload")
    ap.add_argument("--profile", action="store_true",
                    help="the iterations' kernels under torch.profiler, after the timing")
    ap.add_argument("--host-profile", type=int, metavar="N", default=0,
                    help="after the timing, one more generate per run under cProfile: its N costliest functions by "
                         "their own time (cProfile slows every Python call: it ranks the host's work, not times it)")
    ap.add_argument("--no-shared-stream", dest="shared_stream", action="store_false",
                    help="the shared expert on the main stream (EngineConfig.shared_stream off)")
    ap.add_argument("--no-shared-in-moe", dest="shared_in_moe", action="store_false",
                    help="the shared expert with GEMMs of its own (EngineConfig.shared_in_moe off)")
    ap.add_argument("--routing", metavar="TRACE", help="the trace's first request, its routing and commits replayed")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("forward_gaps.py needs a CUDA device", file=sys.stderr)
        return 2
    from oled.bench.workloads import load
    from oled.config import EngineConfig
    from oled.decoding.params import DecodeParams
    from oled.engine import Engine

    weights = ({"model": None if args.model == "bundled" else args.model} if args.model
               else {"random_weights": args.preset})
    engine = Engine(EngineConfig(**weights, policy="full", expert_budget="1.0", cpu_share=args.cpu_share,
                                 shared_stream=args.shared_stream, shared_in_moe=args.shared_in_moe))
    if args.routing:
        decode = replayed_request(engine, args.routing)
    else:
        params = DecodeParams(gen_length=args.gen_length, block_length=32, threshold=0.95)
        prompt_ids = load(args.workload, engine.tokenizer, limit=1).prompts[0].ids(engine.tokenizer)

        def decode():
            return engine.generate_ids(prompt_ids, params)
    results = []
    for run in args.runs.split(","):
        set_run(engine, run)
        results.append(measure(engine, decode, run))
        r = results[-1]
        print(json.dumps({k: v for k, v in r.items() if k not in PER_FORWARD}), flush=True)
    if args.profile:
        for r in results:
            set_run(engine, r["run"])
            decode()                                         # warm-up again: set_runtime rebuilt the graphs
            r.update(profile_decode(engine, decode))
            print(r["run"], "GPU kernels %.3f ms/fwd, copies %.3f ms/fwd, %.0f launches/fwd over %d forwards" % (
                r["gpu_kernel_ms_per_forward"], r["memcpy_ms_per_forward"], r["launches_per_forward"],
                r["profiled_forwards"]))
            for k in r["top_kernels_us_per_forward"]:
                print("   %8.1f us %6.1f x  %s" % (k["us"], k["launches"], k["kernel"]))
            print(r["run"], "GPU idle a forward, by the activities around it:")
            for g in r["idle_us_per_forward"]:
                print("   %8.1f us %6.1f x  %s -> %s" % (g["us"], g["gaps"], g["before"], g["after"]))
    for r in results if args.host_profile else ():
        set_run(engine, r["run"])
        decode()                                             # warm-up again: set_runtime rebuilt the graphs
        print(r["run"], "under cProfile:", host_profile(decode, args.host_profile))
    ref = results[0]["token_ids"]
    for r in results[1:]:
        print(r["run"], "tokens", "equal to" if r["token_ids"] == ref else "DIFFERENT from", results[0]["run"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
