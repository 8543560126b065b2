"""Where the offloaded forward's time goes per MoE layer, against the all-resident forward (H200).

For each POLICY@BUDGET: one warm-up generate, then a timed one with perf_counter around the manager's host steps
(reading the routing back, which includes waiting for its read-back; the residency's decisions; the rest of the two host
steps) and around whole forwards, then one generate under torch.profiler for GPU kernel time and launches.

    python benchmarks/offload_overhead.py [--runs full@1.0,lru@1.0,lru@0.4] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from oled.config import EngineConfig
from oled.decoding.params import DecodeParams
from oled.engine import Engine


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HostClock:
    """Seconds spent inside wrapped callables, by name (the wrapped object keeps working as before)."""

    def __init__(self):
        self.total = defaultdict(float)
        self.calls = defaultdict(int)

    def wrap(self, obj, attr: str, name: str):
        inner = getattr(obj, attr)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.total[name] += time.perf_counter() - t0
                self.calls[name] += 1
        setattr(obj, attr, timed)


def measure(engine: Engine, prompt_ids, params, label: str) -> dict:
    engine.generate_ids(prompt_ids, params)                 # warm-up: graph captures
    sync()
    clock = HostClock()
    m = engine.manager
    clock.wrap(m, "decide_offloaded", "decide_offloaded (host step one)")
    clock.wrap(m, "end_offloaded", "end_offloaded (host step two)")
    clock.wrap(m, "_read_routing", "read_routing (waits for the read-back)")
    clock.wrap(m.residency, "begin_layer", "residency.begin_layer (policy)")
    clock.wrap(m, "_issue_wave", "issue_wave")
    t0 = time.perf_counter()
    res = engine.generate_ids(prompt_ids, params)
    sync()
    wall = time.perf_counter() - t0
    nfe = res.nfe
    host = {k: v / nfe * 1e3 for k, v in clock.total.items()}
    calls = {k: v / nfe for k, v in clock.calls.items()}
    kernels = []
    if torch.cuda.is_available():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate_ids(prompt_ids, params)
            sync()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels if "Memcpy" not in e.name and "Memset" not in e.name)
    out = {"run": label, "nfe": nfe, "tokens": len(res.token_ids), "wall_ms_per_forward": wall / nfe * 1e3,
           "gpu_kernel_ms_per_forward": gpu_us / nfe / 1e3, "kernels_per_forward": len(kernels) / nfe,
           "host_ms_per_forward": host, "calls_per_forward": calls}
    print(json.dumps(out, indent=1), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="full@1.0,lru@1.0,lru@0.4,oled@0.4")
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--preset", default="llada2-mini")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine(EngineConfig(random_weights=args.preset, layers=args.layers, policy="full", expert_budget="1.0"))
    params = DecodeParams(gen_length=args.gen_length, block_length=32, threshold=0.95)
    prompt_ids = engine.tokenizer.encode("def quicksort(items):")
    results = []
    for run in args.runs.split(","):
        policy, budget = run.split("@")
        engine.set_runtime(policy, budget)
        results.append(measure(engine, prompt_ids, params, run))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
