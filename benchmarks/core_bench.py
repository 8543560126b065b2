"""Engine-core benchmark (issue 2): all experts on the GPU, one model, one workload.

Reports TPOT, time per iteration, NFE, TPF, the split between attention / MoE / rest (CUDA events, separate
profiled run), and the time per iteration against its floor: bytes of weights touched per iteration over the
measured device-memory bandwidth.

    python benchmarks/core_bench.py --random-weights llada2-mini --gen-length 256 --out results.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import oled
from oled.bench.floor import measure_hbm_bandwidth, weight_bytes_per_iteration
from oled.config import EngineConfig
from oled.engine import Engine

PROMPT = ("Write a Python function that parses a CSV file, groups the rows by the value of one column and "
          "returns, for each group, the mean of another column. Explain each step.")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-weights", default="llada2-mini")
    ap.add_argument("--model")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--costs", action="store_true", help="also measure the runtime's cost model on this model's "
                    "expert store: H2D GB/s of store blobs and CPU-kernel seconds per expert versus tokens")
    ap.add_argument("--trace", help="also record a routing trace of one request here and write its locality report "
                                    "next to it (.locality.json): saves building the model again for `oled trace`")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfg = EngineConfig(model=args.model, random_weights=None if args.model else args.random_weights,
                       layers=args.layers, expert_budget="1.0", policy="full")
    engine = Engine(cfg)
    load_s = time.perf_counter() - t0
    print(engine.describe(), f"(built in {load_s:.1f} s)", flush=True)
    ids = engine.tokenizer.encode(PROMPT)
    params = oled.DecodeParams(gen_length=args.gen_length, block_length=args.block_length, threshold=args.threshold)
    engine.generate_ids(ids, params)                             # warm-up
    runs = []
    for _ in range(args.repeats):
        engine.manager.stats.reset()
        res = engine.generate_ids(ids, params)
        runs.append(res)
    summary = engine.manager.stats.summary()
    res = runs[len(runs) // 2]
    decode = statistics.median(r.decode_s for r in runs)
    tpot = statistics.median(r.tpot_s for r in runs)
    per_iter = decode / max(res.nfe + res.cache_forwards - 1, 1)
    # profiled run: CUDA-event sections (adds event records, so it is kept out of the timings above)
    engine.timer = engine.manager.timer = oled.runtime.timer.SectionTimer(engine.device)
    prof = engine.generate_ids(ids, params)
    sections = engine.timer.collect()
    forwards = prof.nfe + prof.cache_forwards
    total = sum(v for k, v in sections.items() if k in ("attention", "moe", "dense_mlp", "lm_head"))
    split = {k: v / forwards for k, v in sections.items()}
    split["other_per_forward"] = max(prof.decode_s + prof.prefill_s - total, 0) / forwards
    bw = measure_hbm_bandwidth(engine.device)
    touched = weight_bytes_per_iteration(engine, summary["unique_experts_per_layer_iteration"], args.block_length)
    floor = touched / (bw * 1e9) if bw == bw else float("nan")
    out = {
        "model": engine.model_name, "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "CPU",
        "torch": torch.__version__, "gen_length": args.gen_length, "block_length": args.block_length,
        "threshold": args.threshold, "generated_tokens": len(res.token_ids), "nfe": res.nfe,
        "cache_forwards": res.cache_forwards, "tokens_per_forward": res.tokens_per_forward,
        "iterations_per_block": res.iterations_per_block, "tpot_ms": tpot * 1e3,
        "tokens_per_s": 1 / tpot, "decode_s": decode, "prefill_ms": res.prefill_s * 1e3,
        "time_per_forward_ms": per_iter * 1e3,
        "section_ms_per_forward": {k: v * 1e3 for k, v in split.items()},
        "unique_experts_per_layer_iteration": summary["unique_experts_per_layer_iteration"],
        "weight_bytes_per_iteration_GB": touched / 1e9, "hbm_copy_GBps": bw,
        "floor_ms_per_iteration": floor * 1e3, "gap_vs_floor": per_iter / floor if floor == floor else None,
        "repeats": args.repeats, "all_tpot_ms": [r.tpot_s * 1e3 for r in runs],
    }
    if args.trace:
        from oled.trace import format_locality, locality, record_trace

        trace, _ = record_trace(engine, [("core", ids)], params, workload="core_bench prompt")
        path = trace.save(args.trace)
        rep = locality(trace)
        print(format_locality(rep))
        with open(str(path) + ".locality.json", "w") as f:
            json.dump(rep, f, indent=1)
        out["unique_experts_per_layer_iteration_trace"] = rep["unique_experts_per_layer_iteration"]
    if args.costs:
        from oled.runtime.cost_model import measure
        from oled.runtime.cpu_kernel import CpuExpertKernel

        kernel = CpuExpertKernel(num_threads=engine.threads.kernel_threads)
        costs = measure(engine.store, kernel, engine.device)
        out["cost_model"] = {"kernel": kernel.name, "threads": kernel.num_threads, "h2d_gbps": costs.h2d_gbps,
                             "cpu_us_per_expert": {t: v * 1e6 for t, v in costs.cpu_seconds.items()},
                             "cpu_us_per_call": costs.cpu_call_seconds * 1e6,
                             "cpu_slowdown_with_copies": costs.cpu_slowdown_with_copies}
    print(json.dumps(out, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
