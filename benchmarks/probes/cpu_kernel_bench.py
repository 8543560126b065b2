"""Benchmark the CPU SwiGLU expert kernel against torch's bf16 CPU path, with cold weights.

For each model shape and tokens-per-expert count, one call computes `--jobs` experts (distinct, cycled through a
pool of blobs larger than the L3 so every call reads its weights from DRAM). Reports median µs per expert,
effective GB/s (expert bytes / time) and % of --dram-gbs. With CUDA, the kernel is measured again while a
background thread streams pinned host->device copies, reporting both sides' GB/s.

    python benchmarks/probes/cpu_kernel_bench.py --out cpu_kernel.json           # on the GPU host
    python benchmarks/probes/cpu_kernel_bench.py --quick                          # smoke check anywhere
    python benchmarks/probes/cpu_kernel_bench.py --quick --expert-dtype fp8       # FP8 blobs (no torch baseline)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import threading
import time

import torch

import torch.nn.functional as F

from oled import fp8
from oled.env import cpu_model

from oled.runtime.cpu_calibration import make_cold_blobs
from oled.runtime.cpu_kernel import CpuExpertKernel, l3_bytes

SHAPES = {"mini": (2048, 512), "flash": (4096, 1024)}


def torch_swiglu(x, tok, offs, blobs, I, out):
    """The plain torch bf16 path: per expert, F.linear on the bf16 weights (views of the blob)."""
    H = x.shape[1]
    o = offs.tolist()
    for j, b in enumerate(blobs):
        g, u, d = b[: I * H].view(I, H), b[I * H : 2 * I * H].view(I, H), b[2 * I * H :].view(H, I)
        xs = x[tok[o[j] : o[j + 1]]]
        out[o[j] : o[j + 1]] = F.linear(F.silu(F.linear(xs, g)) * F.linear(xs, u), d).float()


class Pool:
    """Cold blobs cycled `jobs` at a time."""

    def __init__(self, H, I, gib, jobs, expert_dtype="bf16"):
        esize = fp8.blob_bytes(H, I) if expert_dtype == "fp8" else 3 * H * I * 2
        n = max(int(gib * 2**30 // esize), math.ceil(2.5 * l3_bytes() / esize) + jobs, 2 * jobs)
        self.buf, self.blobs = make_cold_blobs(H, I, n, expert_dtype=expert_dtype)
        self.n, self.jobs, self.cursor, self.esize = n, jobs, 0, esize

    def next(self):
        if self.cursor + self.jobs > self.n:
            self.cursor = 0
        b = self.blobs[self.cursor : self.cursor + self.jobs]
        self.cursor += self.jobs
        return b


def time_calls(fn, pool, reps, min_s):
    """Per-expert seconds of each call; at least `reps` calls and `min_s` seconds (after one warm-up call)."""
    fn(pool.next())
    times, t_start = [], time.perf_counter()
    while len(times) < reps or time.perf_counter() - t_start < min_s:
        b = pool.next()
        t0 = time.perf_counter()
        fn(b)
        times.append((time.perf_counter() - t0) / len(b))
    return times


class CopyStreamer(threading.Thread):
    """Background pinned H2D copies (its own pinned source, larger than the L3) on a side stream."""

    def __init__(self, chunk_mib=64, n_chunks=8):
        super().__init__(daemon=True)
        n = chunk_mib * 2**20
        self.src = [torch.empty(n, dtype=torch.uint8, pin_memory=True).copy_(torch.randint(0, 255, (n,), dtype=torch.uint8))
                    for _ in range(n_chunks)]
        self.dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.bytes_done = 0
        self.stop = False
        self.lock = threading.Lock()

    def run(self):
        i = 0
        with torch.cuda.stream(self.stream):
            while not self.stop:
                for _ in range(2):
                    self.dst.copy_(self.src[i % len(self.src)], non_blocking=True)
                    i += 1
                self.stream.synchronize()
                with self.lock:
                    self.bytes_done += 2 * self.dst.numel()

    def snapshot(self):
        with self.lock:
            return self.bytes_done, time.perf_counter()

    def rate(self, seconds):
        b0, t0 = self.snapshot()
        time.sleep(seconds)
        b1, t1 = self.snapshot()
        return (b1 - b0) / (t1 - t0) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write results as JSON here")
    ap.add_argument("--quick", action="store_true", help="small pool, few repeats, mini shape only (smoke check)")
    ap.add_argument("--shapes", default=None, help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    ap.add_argument("--jobs", type=int, default=16, help="experts per call")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--pool-gib", type=float, default=2.0, help="cold blob pool size per shape")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dram-gbs", type=float, default=82.0, help="reference DRAM read bandwidth")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    ap.add_argument("--portable", action="store_true", help="benchmark the portable path")
    ap.add_argument("--expert-dtype", choices=("bf16", "fp8"), default="bf16",
                    help="the blobs' dtype (fp8: oled/fp8.py's blobs; no torch baseline)")
    args = ap.parse_args()
    if args.expert_dtype == "fp8":
        args.no_torch = True

    if args.quick:
        shapes = args.shapes or "mini"
        args.pool_gib, args.reps, min_s = 0.25, 3, 0.0
        args.jobs = min(args.jobs, 8)
    else:
        shapes = args.shapes or "mini,flash"
        min_s = 0.3
    tokens = [int(t) for t in args.tokens.split(",")]
    dram = measure_read_gbs(0.25 if args.quick else 1.0)
    kernel = CpuExpertKernel(num_threads=args.threads, isa="portable" if args.portable else "auto")
    cuda = torch.cuda.is_available()
    meta = dict(kernel=kernel.name, threads=kernel.num_threads, cpus=kernel.cpus, torch_threads=torch.get_num_threads(),
                torch=torch.__version__, machine=platform.machine(), processor=cpu_model(), l3_bytes=l3_bytes(),
                jobs_per_call=args.jobs, dram_gbs=args.dram_gbs, cuda=cuda, quick=args.quick,
                expert_dtype=args.expert_dtype,
                measured_read_gbs=dram, prefetch=kernel.knobs["prefetch"])
    print(f"# kernel={kernel.name} threads={kernel.num_threads} torch_threads={torch.get_num_threads()} "
          f"cpu={meta['processor']} jobs/call={args.jobs} cuda={cuda}")
    print(f"# torch fp32 sum over {1 if not args.quick else 0.25} GiB: {dram:.1f} GB/s read "
          f"(reference for %dram: {args.dram_gbs} GB/s)")
    rows = []
    streamer = None
    if cuda:
        streamer = CopyStreamer()
        streamer.start()
        streamer.stop = True  # started once to allocate/warm; restarted per measurement below
        streamer.join()
    hdr = (f"{'shape':6} {'tok':>4} | {'kern µs/exp':>11} {'GB/s':>6} {'%dram':>6} | {'torch µs/exp':>12} {'GB/s':>6}"
           f" {'speedup':>7}" + (" | {:>11} {:>6} {:>8} {:>8}".format('+H2D µs/exp', 'GB/s', 'H2D GB/s', 'H2D only')
                                 if cuda else ""))
    print(hdr)
    print("-" * len(hdr))
    for shape in shapes.split(","):
        H, I = SHAPES[shape]
        pool = Pool(H, I, args.pool_gib, args.jobs, args.expert_dtype)
        gb = pool.esize / 1e9
        # token counts per job; "skew": one expert with 32 tokens, the others with 1 (per-expert time = call / jobs)
        for nt in tokens + ["skew"]:
            counts = [32] + [1] * (args.jobs - 1) if nt == "skew" else [nt] * args.jobs
            P = sum(counts)
            x = torch.randn(P, H).bfloat16()
            tok = torch.arange(P, dtype=torch.int64)
            offs = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0)
            out = torch.empty(P, H)
            run_k = lambda b: kernel.run(x, tok, offs, b, I, out)  # noqa: E731
            kt = statistics.median(time_calls(run_k, pool, args.reps, min_s))
            row = dict(shape=shape, H=H, I=I, tokens=nt, expert_bytes=pool.esize, kernel_us=kt * 1e6,
                       kernel_gbs=gb / kt, kernel_pct_dram=100 * gb / kt / args.dram_gbs)
            line = f"{shape:6} {nt!s:>4} | {kt * 1e6:>11.1f} {gb / kt:>6.1f} {row['kernel_pct_dram']:>5.0f}% |"
            if not args.no_torch:
                run_t = lambda b: torch_swiglu(x, tok, offs, b, I, out)  # noqa: E731
                tt = statistics.median(time_calls(run_t, pool, max(3, args.reps // 4), min_s / 3))
                row.update(torch_us=tt * 1e6, torch_gbs=gb / tt)
                line += f" {tt * 1e6:>12.1f} {gb / tt:>6.1f} {tt / kt:>6.1f}x"
            else:
                line += " " * 28
            if cuda:
                streamer = CopyStreamer()
                streamer.start()
                copy_only = streamer.rate(0.3)
                b0, t0 = streamer.snapshot()
                ct = statistics.median(time_calls(run_k, pool, args.reps, max(min_s, 0.3)))
                b1, t1 = streamer.snapshot()
                streamer.stop = True
                streamer.join()
                h2d = (b1 - b0) / (t1 - t0) / 1e9
                row.update(concurrent_kernel_us=ct * 1e6, concurrent_kernel_gbs=gb / ct, concurrent_h2d_gbs=h2d,
                           h2d_only_gbs=copy_only)
                line += f" | {ct * 1e6:>11.1f} {gb / ct:>6.1f} {h2d:>8.1f} {copy_only:>8.1f}"
            print(line, flush=True)
            rows.append(row)
        del pool
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(f"# wrote {args.out}")


def measure_read_gbs(gib):
    """Rough DRAM read bandwidth with torch's threads (fp32 sum of a buffer far larger than the L3)."""
    a = torch.arange(int(gib * 2**30) // 4, dtype=torch.float32)  # distinct pages
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        ts.append(time.perf_counter() - t0)
    return a.numel() * 4 / min(ts) / 1e9



if __name__ == "__main__":
    main()
