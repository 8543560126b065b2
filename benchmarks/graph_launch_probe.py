"""The host's time to launch a CUDA graph against the nodes it holds (H200).

A mapped forward's graph took 0.55 ms of host time a `replay()` against 0.06 ms for
`full`'s, with about the same number of kernels (443 against 403 launches a forward). What it has and `full`'s graph
has not: per MoE layer, two device-to-host copies of the routing into pinned buffers and two external event records
(ExpertManager._issue_readback, run_mapped). This probe captures graphs of the same shape, small kernels with and
without those nodes, and with a kernel storing into pinned (mapped) host memory in place of each copy, and times
`replay()` on the host (the GPU idle before each) and to the end of the graph's work.

    python benchmarks/graph_launch_probe.py [--kernels 400] [--layers 19] [--repeats 50] [--out FILE.json]

Prints one JSON line per graph: the host's launch µs and the launch-to-done µs, medians of --repeats replays.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

VARIANTS = {                      # name -> (copies a layer, event records a layer, kernel stores to host a layer)
    "kernels": (0, 0, 0),
    "kernels + D2H copies": (2, 0, 0),
    "kernels + external events": (0, 2, 0),
    "kernels + D2H copies + external events (the mapped forward's)": (2, 2, 0),
    "kernels + mapped stores": (0, 0, 2),
    "kernels + mapped stores + external events": (0, 2, 2),
}


def store_to_host():
    """A Triton kernel copying n floats into a pinned host buffer through its mapped address (no copy engine)."""
    import triton
    import triton.language as tl

    @triton.jit
    def store(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    return lambda src, dst: store[(1,)](src, dst, src.numel(), BLOCK=triton.next_power_of_2(src.numel()))


def capture(kernels: int, layers: int, copies: int, events: int, stores: int, device
            ) -> tuple[torch.cuda.CUDAGraph, list]:
    """A graph of `kernels` small in-place kernels, with `copies` device-to-host copies into pinned buffers,
    `events` external event records and `stores` kernels storing into pinned buffers after each of `layers` evenly
    spaced kernels. Returns the graph and what it references (kept alive with it)."""
    x = torch.zeros(4096, device=device)
    pinned = [torch.empty(256, pin_memory=True) for _ in range(layers * (copies + stores))]
    store = store_to_host() if stores else None
    marks = [torch.cuda.Event(external=True) for _ in range(layers * events)]
    every = max(kernels // max(layers, 1), 1)

    def body():
        layer = 0
        for i in range(kernels):
            x.add_(1.0)
            if (i + 1) % every == 0 and layer < layers:
                for c in range(copies):
                    pinned[layer * copies + c].copy_(x[:256], non_blocking=True)
                for c in range(stores):
                    store(x[:256], pinned[layer * stores + c])
                for e in range(events):
                    marks[layer * events + e].record()
                layer += 1

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        body()                                   # warm-up outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    # after a replay, layer i's buffers hold x as it was (i + 1) * every kernels in
    expected = [(i + 1) * every - kernels for i in range(layers) for _ in range(copies + stores)]
    return graph, [x, pinned, expected, marks]


def time_replays(graph: torch.cuda.CUDAGraph, repeats: int) -> dict:
    launch, done = [], []
    for i in range(repeats + 3):                 # the first three replays are not timed (upload, caches)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 3:
            launch.append((t1 - t0) * 1e6)
            done.append((t2 - t0) * 1e6)
    return {"launch_us": statistics.median(launch), "launch_to_done_us": statistics.median(done)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=400, help="small kernels in each graph (full's forward: 399)")
    ap.add_argument("--layers", type=int, default=19, help="MoE layers: where the read-back nodes go")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_launch_probe.py needs a CUDA device", file=sys.stderr)
        return 2
    if args.kernels < 1 or args.layers < 0 or args.repeats < 1:
        ap.error("--kernels and --repeats must be >= 1, --layers >= 0")
    device = torch.device("cuda")
    lines = []
    for name, (copies, events, stores) in VARIANTS.items():
        graph, keep = capture(args.kernels, args.layers, copies, events, stores, device)
        record = {"bench": "graph_launch", "graph": name, "kernels": args.kernels, "layers": args.layers,
                  "d2h_copies": args.layers * copies, "event_records": args.layers * events,
                  "host_stores": args.layers * stores,
                  "repeats": args.repeats, **time_replays(graph, args.repeats)}
        x, pinned, expected, _ = keep
        # every copy and store has landed in host memory, with the value x had where it was issued
        final = float(x[0])
        record["host_buffers_right"] = all(bool((p == final + d).all()) for p, d in zip(pinned, expected))
        print(json.dumps(record), flush=True)
        lines.append(record)
        graph.reset()
        del keep
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
