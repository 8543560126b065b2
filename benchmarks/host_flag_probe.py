"""How long a GPU kernel takes to see a mark the host stores in pinned memory, and what a layer pays when the GPU waits
for the CPU's part of it: the signal a mapped forward would need for the CPU to compute part of a layer's misses
inside the forward (built since as --cpu-share; BENCHMARKS.md, finding *CUDA graph launch*). CUDA only.

  round trip  one kernel and the host thread take turns through two int32 words of pinned memory: the kernel stores
              i, the host sees it and stores i into the other word, the kernel sees that and goes on to i + 1.
              Reported: µs an exchange (two crossings and both sides' polling), the median of --repeats runs of
              --rounds exchanges.
  layers      a CUDA graph of --layers layers, each: a mark "routing ready" stored into pinned memory, a kernel
              that keeps the GPU busy --gpu-us (the layer's own work: its hits and the misses it reads itself), a
              kernel that waits for the host's mark "CPU rows ready", then a copy of the CPU's output rows to the
              device (with --routing-known end, the mark comes after the busy kernel: the CPU's work follows the
              GPU's instead of running beside it). The host thread waits for each layer's first mark, runs the engine's CPU expert kernel on --experts cold experts of --tokens tokens (blobs of
              LLaDA2.0-mini's shape, --hidden x --intermediate) writing pinned rows, and stores the second mark.
              Reported, ms a layer (medians of --repeats graphs): the GPU alone (the graph without waits), the CPU
              alone (the same jobs back to back), both together, and together - max(GPU, CPU): what the hand-over
              costs. A wait gives up after --timeout-ms (counted: a timed-out wait means the forward could not have
              trusted the CPU's rows).

    python benchmarks/host_flag_probe.py --gpu-us 100,200,400 --experts 1,2 --tokens 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
import triton
import triton.language as tl

from oled.runtime.cpu_calibration import make_cold_blobs
from oled.runtime.cpu_kernel import CpuExpertKernel

LLADA2_MINI = (2048, 512)       # hidden, moe intermediate


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _wait_for(flag_ptr, value, timeout_ns):
    """Poll a pinned int32 (volatile loads: each crosses PCIe) until it equals value or timeout_ns pass; True if seen."""
    start = _now_ns()
    seen = tl.load(flag_ptr, volatile=True)
    while (seen != value) & (_now_ns() - start < timeout_ns):
        seen = tl.load(flag_ptr, volatile=True)
    return seen == value


@triton.jit
def _ping_pong_kernel(ping_ptr, pong_ptr, result_ptr, rounds, timeout_ns):
    misses = 0
    for i in range(1, rounds + 1):
        tl.atomic_xchg(ping_ptr, i, sem="release", scope="sys")
        misses += 1 - _wait_for(pong_ptr, i, timeout_ns).to(tl.int32)
    tl.store(result_ptr, misses)


@triton.jit
def _busy_kernel(busy_ns):
    start = _now_ns()
    now = start
    while now - start < busy_ns:
        now = _now_ns()


@triton.jit
def _mark_kernel(flag_ptr, value):
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def _wait_kernel(flag_ptr, value, timeout_ns, missed_ptr):
    ok = _wait_for(flag_ptr, value, timeout_ns)
    tl.atomic_add(missed_ptr, 1 - ok.to(tl.int32))


def _host_poll(word: np.ndarray, value: int, deadline: float) -> bool:
    while word[0] != value:
        if time.perf_counter() > deadline:
            return False
    return True


def round_trip(rounds: int, repeats: int, timeout_ms: float) -> dict:
    ping, pong = (torch.zeros(1, dtype=torch.int32, pin_memory=True) for _ in range(2))
    result = torch.zeros(1, dtype=torch.int32, device="cuda")
    ping_h, pong_h = ping.numpy(), pong.numpy()
    per_exchange, misses = [], 0
    for _ in range(repeats + 1):                        # the first run compiles and warms up
        ping_h[0] = pong_h[0] = 0
        torch.cuda.synchronize()
        start = time.perf_counter()
        _ping_pong_kernel[(1,)](ping, pong, result, rounds, int(timeout_ms * 1e6), num_warps=1)
        deadline = start + 10.0 + rounds * timeout_ms / 1e3
        for i in range(1, rounds + 1):
            if not _host_poll(ping_h, i, deadline):
                break
            pong_h[0] = i
        torch.cuda.synchronize()
        per_exchange.append((time.perf_counter() - start) / rounds)
        misses += int(result.item())
    return {"rounds": rounds, "us_per_exchange": statistics.median(per_exchange[1:]) * 1e6,
            "timed_out": misses}


class LayerProbe:
    """The graph of `layers` layers and the host's side of each; see the module's docstring."""

    def __init__(self, kernel: CpuExpertKernel, layers: int, gpu_us: float, experts: int, tokens: int,
                 hidden: int, intermediate: int, timeout_ms: float, wait: bool, mark_first: bool = True):
        self.kernel, self.layers, self.experts, self.tokens = kernel, layers, experts, tokens
        self.intermediate = intermediate
        # cold blobs: more than fit a last-level cache, one distinct set a layer
        self._buf, self.blobs = make_cold_blobs(hidden, intermediate, max(layers * experts, 64), pin=True)
        self.x = (torch.randn(tokens, hidden) * 0.1).to(torch.bfloat16)
        self.token_idx = torch.arange(tokens, dtype=torch.int64).repeat(experts)
        self.offsets = torch.arange(experts + 1, dtype=torch.int64) * tokens
        self.rows = torch.zeros(layers, experts * tokens, hidden, dtype=torch.float32, pin_memory=True)
        self.ready, self.done = (torch.zeros(1, dtype=torch.int32, pin_memory=True) for _ in range(2))
        self.ready_h, self.done_h = self.ready.numpy(), self.done.numpy()
        self.missed = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.acc = torch.zeros(experts * tokens, hidden, dtype=torch.float32, device="cuda")
        self.wait, self.timeout_ms, self.mark_first = wait, timeout_ms, mark_first
        busy_ns, timeout_ns = int(gpu_us * 1e3), int(timeout_ms * 1e6)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):       # compile outside the capture
            self._layers(busy_ns, timeout_ns, warm=True)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            self._layers(busy_ns, timeout_ns)

    def _layers(self, busy_ns: int, timeout_ns: int, warm: bool = False) -> None:
        for layer in range(self.layers):
            if self.wait and self.mark_first:   # the routing known as the layer's work starts (the router runs first)
                _mark_kernel[(1,)](self.ready, layer + 1, num_warps=1)
            _busy_kernel[(1,)](0 if warm else busy_ns, num_warps=1)
            if self.wait and not self.mark_first:
                _mark_kernel[(1,)](self.ready, layer + 1, num_warps=1)
            if self.wait:
                _wait_kernel[(1,)](self.done, 0 if warm else layer + 1, 0 if warm else timeout_ns, self.missed,
                                   num_warps=1)
                self.acc.add_(self.rows[layer].to("cuda", non_blocking=True))

    def cpu_layer(self, layer: int) -> None:
        blobs = self.blobs[layer * self.experts:(layer + 1) * self.experts]
        self.kernel.run(self.x, self.token_idx, self.offsets, blobs, self.intermediate, self.rows[layer])

    def run(self, with_cpu: bool) -> float:
        """One replay of the graph, the host doing each layer's CPU part when with_cpu: seconds of wall time."""
        self.ready_h[0] = self.done_h[0] = 0
        self.missed.zero_()
        torch.cuda.synchronize()
        self.kernel.hold(1.0)
        start = time.perf_counter()
        self.graph.replay()
        deadline = start + 10.0 + self.layers * self.timeout_ms / 1e3
        if with_cpu:
            for layer in range(self.layers):
                if not _host_poll(self.ready_h, layer + 1, deadline):
                    break
                self.cpu_layer(layer)
                self.done_h[0] = layer + 1
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        self.kernel.hold(0.0)
        return elapsed

    def cpu_alone(self) -> float:
        self.kernel.hold(1.0)
        start = time.perf_counter()
        for layer in range(self.layers):
            self.cpu_layer(layer)
        elapsed = time.perf_counter() - start
        self.kernel.hold(0.0)
        return elapsed


def layers_case(kernel, args, gpu_us: float, experts: int) -> dict:
    make = {"layers": args.layers, "gpu_us": gpu_us, "experts": experts, "tokens": args.tokens,
            "hidden": args.hidden, "intermediate": args.intermediate, "timeout_ms": args.timeout_ms,
            "mark_first": args.routing_known == "start"}
    alone = LayerProbe(kernel, wait=False, **make)
    both = LayerProbe(kernel, wait=True, **make)
    gpu, cpu, together = [], [], []
    for _ in range(args.repeats + 1):                   # the first of each warms up
        gpu.append(alone.run(with_cpu=False))
        cpu.append(both.cpu_alone())
        together.append(both.run(with_cpu=True))
    per_layer = {name: statistics.median(times[1:]) / args.layers * 1e3
                 for name, times in (("gpu_ms", gpu), ("cpu_ms", cpu), ("together_ms", together))}
    per_layer["handover_ms"] = per_layer["together_ms"] - max(per_layer["gpu_ms"], per_layer["cpu_ms"])
    # the GPU added the rows the CPU wrote, not what the buffer held before: zeroed, then one more run
    timed_out = int(both.missed.item())
    both.rows.zero_()
    before = both.acc.cpu()
    both.run(with_cpu=True)
    expected = before
    for layer in range(args.layers):
        expected = expected + both.rows[layer]
    return {"gpu_us": gpu_us, "experts": experts, "tokens": args.tokens, "layers": args.layers,
            "routing_known": args.routing_known, **per_layer,
            "timed_out_waits": timed_out + int(both.missed.item()),
            "gpu_got_the_cpu_rows": bool(torch.equal(expected, both.acc.cpu())) and bool(both.rows.abs().sum() > 0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2000, help="exchanges a round-trip run makes")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=19, help="layers a graph holds (LLaDA2.0-mini: 19 MoE layers)")
    ap.add_argument("--gpu-us", default="100,200,400", help="the GPU's own work a layer, µs (comma-separated)")
    ap.add_argument("--experts", default="1,2,4", help="experts the CPU computes a layer (comma-separated)")
    ap.add_argument("--tokens", type=int, default=2, help="tokens an expert the CPU computes")
    ap.add_argument("--hidden", type=int, default=LLADA2_MINI[0])
    ap.add_argument("--intermediate", type=int, default=LLADA2_MINI[1])
    ap.add_argument("--threads", type=int, default=None, help="CPU kernel workers (default: the engine's)")
    ap.add_argument("--routing-known", choices=("start", "end"), default="start",
                    help="the mark 'routing ready' before the layer's GPU work (start: the CPU works beside it) or after "
                         "it (end: the two run one after the other, which shows the hand-over's own latency)")
    ap.add_argument("--timeout-ms", type=float, default=20.0, help="a wait gives up after this long")
    ap.add_argument("--out", default=None, help="write the results as JSON here too")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_flag_probe.py needs a CUDA device", file=sys.stderr)
        return 2
    gpu_list = [float(v) for v in args.gpu_us.split(",")]
    expert_list = [int(v) for v in args.experts.split(",")]
    if args.rounds < 1 or args.repeats < 1 or args.layers < 1 or args.tokens < 1 or min(expert_list) < 1 \
            or min(gpu_list) < 0 or args.timeout_ms <= 0:
        raise SystemExit("host_flag_probe: --rounds, --repeats, --layers, --tokens, --experts must be >= 1, "
                         "--gpu-us >= 0, --timeout-ms > 0")
    result = {"round_trip": round_trip(args.rounds, args.repeats, args.timeout_ms), "layers": []}
    rt = result["round_trip"]
    print(f"round trip: {rt['us_per_exchange']:.2f} µs an exchange ({rt['rounds']} exchanges, median of "
          f"{args.repeats}; timed out {rt['timed_out']})", flush=True)
    kernel = CpuExpertKernel(num_threads=args.threads)
    print(f"{'GPU µs':>7} {'experts':>7} {'GPU ms':>8} {'CPU ms':>8} {'both ms':>8} {'hand-over ms':>12} "
          f"{'timed out':>9} {'rows ok':>7}")
    try:
        for gpu_us in gpu_list:
            for experts in expert_list:
                row = layers_case(kernel, args, gpu_us, experts)
                result["layers"].append(row)
                print(f"{gpu_us:7.0f} {experts:7d} {row['gpu_ms']:8.3f} {row['cpu_ms']:8.3f} {row['together_ms']:8.3f} "
                      f"{row['handover_ms']:12.3f} {row['timed_out_waits']:9d} {row['gpu_got_the_cpu_rows']!s:>7}",
                      flush=True)
    finally:
        kernel.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
