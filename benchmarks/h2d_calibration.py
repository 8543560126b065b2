"""How steady the cost model's start-up measurement of the copy path's bandwidth is (oled/runtime/cost_model.py
`h2d_gbps`). CUDA only.

Three H200 processes measured 25-28 GB/s at start-up where the others measured 51-54, and in one of them the engine's
own copies ran at 46.6 (BENCHMARKS.md section 30); the planner then costs every load twice too high. This probe runs
--processes fresh processes, each on a freshly pinned store of LLaDA2.0-mini's expert shape, with the CPU expert
kernel's workers just started (as the engine starts them right before it measures; --no-cpu-kernel: without), and
prints per process: the PCIe link's generation and width and the GPU's performance state, the first estimator's
figure (three rounds of --experts copies timed by the host's clock, no warm-up: `h2d_gbps` before section 30), the
engine's `h2d_gbps` (alternately first and second, so that neither always meets the process's first copies), then
--rounds host-clocked rounds back to back and the same copies from pageable memory once.

    python benchmarks/h2d_calibration.py --processes 6 --out h2d_calibration.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from oled.models.config import config_from_dict
from oled.runtime.cost_model import h2d_gbps
from oled.runtime.store import ExpertStore
from oled.synth import preset_config


def host_clocked_round(src, dst) -> float:
    """GB/s of one batch of per-blob copies timed by the host's clock (synchronize, copies, synchronize)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(len(src)):
        dst[i].copy_(src[i], non_blocking=True)
    torch.cuda.synchronize()
    return src.numel() * src.element_size() / 1e9 / (time.perf_counter() - t0)


def child(experts: int, rounds: int, cpu_kernel: bool, engine_first: bool) -> dict:
    torch.cuda.init()
    store = ExpertStore(config_from_dict(preset_config("llada2-mini", 2)), torch.bfloat16, pin=True)
    kernel = None
    if cpu_kernel:
        from oled.runtime.cpu_kernel import CpuExpertKernel
        from oled.runtime.threads import plan_threads
        kernel = CpuExpertKernel(num_threads=plan_threads().kernel_threads)
    src = store.blobs[0][:experts]
    link_before = link_state()

    def first_estimator() -> float:
        dst = torch.empty_like(src, device="cuda")
        return max(host_clocked_round(src, dst) for _ in range(3))

    if engine_first:
        engine = h2d_gbps(store, "cuda", experts)
        first = first_estimator()
    else:
        first = first_estimator()
        engine = h2d_gbps(store, "cuda", experts)
    dst = torch.empty_like(src, device="cuda")
    later = [host_clocked_round(src, dst) for _ in range(rounds)]
    pageable = host_clocked_round(torch.empty(src.shape, dtype=src.dtype).copy_(src), dst)
    del kernel
    return {"pinned": store.pinned, "cpu_kernel": cpu_kernel, "engine_first": engine_first,
            "link_before": link_before, "link_after": link_state(), "first_estimator_gbps": round(first, 1),
            "h2d_gbps": round(engine, 1), "later_rounds_gbps": [round(x, 1) for x in later],
            "pageable_gbps": round(pageable, 1)}


def link_state() -> str:
    """The GPU's PCIe generation and width now, and its performance state (nvidia-smi), or why not known."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=pcie.link.gen.current,pcie.link.width.current,pstate",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        return done.stdout.strip() or done.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--experts", type=int, default=16, help="copies a round (h2d_gbps: 16)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--no-cpu-kernel", dest="cpu_kernel", action="store_false")
    ap.add_argument("--out")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("h2d_calibration.py needs a CUDA device", file=sys.stderr)
        return 2
    if args.child is not None:
        print(json.dumps(child(args.experts, args.rounds, args.cpu_kernel, engine_first=args.child % 2 == 0)))
        return 0
    results = []
    for p in range(args.processes):
        cmd = [sys.executable, __file__, "--child", str(p), "--experts", str(args.experts), "--rounds",
               str(args.rounds)] + ([] if args.cpu_kernel else ["--no-cpu-kernel"])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            print(f"process {p} failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        r = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(r)
        order = "h2d_gbps first" if r["engine_first"] else "first estimator first"
        print(f"process {p} ({order}): link {r['link_before']} -> {r['link_after']}; first estimator "
              f"{r['first_estimator_gbps']} GB/s, h2d_gbps {r['h2d_gbps']}; later rounds {r['later_rounds_gbps']}; "
              f"pageable {r['pageable_gbps']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"experts": args.experts, "processes": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
