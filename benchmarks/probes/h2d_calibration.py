"""How steady the cost model's start-up measurement of the copy path's bandwidth is (oled/runtime/cost_model.py
`h2d_gbps`), and whether it depends on which layer's pinned memory the copies come from. CUDA only.

Five H200 processes measured 25-34 GB/s at start-up from layer 0's first 16 experts where the others measured
50.6-54.3, and one of them copied at 46.6 GB/s in its runs (BENCHMARKS.md section 30); the planner then costs
every load too high. This probe runs --processes fresh processes, each on a freshly pinned store of LLaDA2.0-mini's
shape (--layers MoE layers, all 19 by default, as the engine allocates them), with the CPU expert kernel's workers
just started as the engine starts them right before it measures (--no-cpu-kernel: without), and prints per process:
the machine's NUMA nodes and the GPU's, the PCIe link's generation and width and the GPU's performance state, each
layer's copy rate (16 experts of that layer, GPU-timed, the best of 3 rounds), and `h2d_gbps` as the engine calls it
(blobs from every layer in turn).

    python benchmarks/probes/h2d_calibration.py --processes 3 --out h2d_calibration.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from oled.models.config import config_from_dict
from oled.runtime.cost_model import h2d_gbps
from oled.runtime.store import ExpertStore
from oled.synth import preset_config


def layer_gbps(store, layer: int, experts: int, rounds: int = 3) -> float:
    """GB/s of `experts` per-blob copies of one layer, timed with CUDA events, the best of `rounds`."""
    src = store.blobs[store.layer_pos[layer]][:experts]
    dst = torch.empty_like(src, device="cuda")
    best = float("inf")
    for _ in range(rounds + 1):                 # the first round untimed
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(experts):
            dst[i].copy_(src[i], non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return src.numel() * src.element_size() / 1e9 / best


def child(layers: int | None, experts: int, cpu_kernel: bool) -> dict:
    torch.cuda.init()
    store = ExpertStore(config_from_dict(preset_config("llada2-mini", None if layers is None else layers + 1)),
                        torch.bfloat16, pin=True)
    kernel = None
    if cpu_kernel:
        from oled.runtime.cpu_kernel import CpuExpertKernel
        from oled.runtime.threads import plan_threads
        kernel = CpuExpertKernel(num_threads=plan_threads().kernel_threads)
    link = link_state()
    engine = h2d_gbps(store, "cuda")
    per_layer = {layer: round(layer_gbps(store, layer, experts), 1) for layer in store.layers}
    del kernel
    return {"pinned": store.pinned, "cpu_kernel": cpu_kernel, "link": link, "h2d_gbps": round(engine, 1),
            "layer_gbps": per_layer}


def link_state() -> str:
    """The GPU's PCIe generation and width now, its performance state and its PCI bus (nvidia-smi), or why not."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=pcie.link.gen.current,pcie.link.width.current,pstate,"
                               "pci.bus_id", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        return done.stdout.strip() or done.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"


def numa() -> dict:
    """The host's NUMA nodes and their CPUs, and the NUMA node of every NVIDIA PCI device (sysfs)."""
    nodes = {p.name: (p / "cpulist").read_text().strip()
             for p in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))}
    gpus = {}
    for dev in Path("/sys/bus/pci/devices").glob("*"):
        try:
            if (dev / "vendor").read_text().strip() == "0x10de":
                gpus[dev.name] = (dev / "numa_node").read_text().strip()
        except OSError:
            continue
    return {"nodes": nodes, "nvidia_devices_node": gpus}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="MoE layers of the store (default: all 19)")
    ap.add_argument("--experts", type=int, default=16, help="copies a round per layer")
    ap.add_argument("--no-cpu-kernel", dest="cpu_kernel", action="store_false")
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("h2d_calibration.py needs a CUDA device", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(child(args.layers, args.experts, args.cpu_kernel)))
        return 0
    host = numa()
    print(f"NUMA nodes {host['nodes']}; NVIDIA devices' nodes {host['nvidia_devices_node']}", flush=True)
    results = []
    for p in range(args.processes):
        cmd = [sys.executable, __file__, "--child", "--experts", str(args.experts)]
        cmd += ([] if args.layers is None else ["--layers", str(args.layers)])
        cmd += ([] if args.cpu_kernel else ["--no-cpu-kernel"])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            print(f"process {p} failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        r = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(r)
        rates = list(r["layer_gbps"].values())
        print(f"process {p}: link {r['link']}; h2d_gbps {r['h2d_gbps']} GB/s; per layer {min(rates)}-{max(rates)}: "
              f"{r['layer_gbps']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"experts": args.experts, "numa": host, "processes": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
