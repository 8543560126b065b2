"""Where a denoising iteration's time goes on the GPU's timeline: the forward against the idle gap before the next (H200).

For each POLICY@BUDGET: one warm-up generate, then one with a CUDA event recorded on the compute stream as each
forward is handed to the model runner and another as the runner returns (the graph launched). Between a forward's
first event and its second lie its launch and its work; between its second and the next forward's first, everything
the stream runs or waits for in between: the prediction's kernels and read-back, the host's decisions and the loop's
bookkeeping while the GPU idles. Reports medians over the steady-state iterations (a block's first forward, which
also writes the previous block's K/V, is left out) in ms, and the host's time inside the runner call (the launch), so
that an offloaded path's extra time splits into a longer forward and a longer gap.

    python benchmarks/forward_gaps.py [--runs full@1.0,oled@0.4] [--workload code --gen-length 256] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def measure(engine, prompt_ids, params, label: str) -> dict:
    engine.generate_ids(prompt_ids, params)                  # warm-up: graph captures
    torch.cuda.synchronize()
    runner = engine.runner
    inner = runner.forward
    marks: list[tuple] = []                                   # (start event, end event, host s, kind)

    def timed(ids, start, kv, kv_end, rows, **kw):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        t0 = time.perf_counter()
        out = inner(ids, start, kv, kv_end, rows, **kw)
        host = time.perf_counter() - t0
        end.record()
        marks.append((begin, end, host, rows is not None and (rows.start or 0) == 0))
        return out

    runner.forward = timed
    try:
        res = engine.generate_ids(prompt_ids, params)
        torch.cuda.synchronize()
    finally:
        del runner.forward                                   # the instance attribute shadowed the method
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
            "forward_ms_mean": statistics.fmean(forward), "gap_ms_mean": statistics.fmean(gap) if gap else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="full@1.0,oled@0.4")
    ap.add_argument("--preset", default="llada2-mini")
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--workload", default="code", help="decode the first prompt of this workload")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("forward_gaps.py needs a CUDA device", file=sys.stderr)
        return 2
    from oled.bench.workloads import load
    from oled.config import EngineConfig
    from oled.decoding.params import DecodeParams
    from oled.engine import Engine

    engine = Engine(EngineConfig(random_weights=args.preset, policy="full", expert_budget="1.0"))
    params = DecodeParams(gen_length=args.gen_length, block_length=32, threshold=0.95)
    prompt_ids = load(args.workload, engine.tokenizer, limit=1).prompts[0].ids(engine.tokenizer)
    results = []
    for run in args.runs.split(","):
        policy, budget = run.split("@")
        engine.set_runtime(policy, budget)
        results.append(measure(engine, prompt_ids, params, run))
        r = results[-1]
        print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}), flush=True)
    ref = results[0]["token_ids"]
    for r in results[1:]:
        print(r["run"], "tokens", "equal to" if r["token_ids"] == ref else "DIFFERENT from", results[0]["run"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
