"""The CPU expert kernel's calibration: its time per expert with cold weights (per tokens an expert) and the fixed
time of a call, for the runtime's cost model (runtime/cost_model.py); cold blobs for any benchmark of it.
"""
from __future__ import annotations

import math
import time

import torch

from .. import fp8
from .cpu_kernel import CpuExpertKernel, l3_bytes

COLD_SCALE = 2.0**-8     # an FP8 cold blob's scales: weights of the prototype's size


def make_cold_blobs(hidden: int, intermediate: int, n: int, dtype=torch.bfloat16, pin: bool = False,
                    expert_dtype: str = "bf16"):
    """n expert blobs as views of one buffer, filled cheaply: blob i is a random prototype shifted by i elements,
    so no two pages are equal (identical pages could be merged by the OS or hypervisor and then stay cached).
    expert_dtype "fp8": FP8 blobs (oled/fp8.py), the prototype's e4m3 weights shifted, every scale COLD_SCALE."""
    if expert_dtype == "fp8":
        weights = 3 * intermediate * hidden
        proto = (torch.randn(weights + n) * 0.02 / COLD_SCALE).to(fp8.FP8).view(fp8.BLOB)
        buf = torch.empty(n, fp8.blob_bytes(hidden, intermediate), dtype=fp8.BLOB, pin_memory=pin)
        _, scales = fp8.blob_views(buf, hidden, intermediate)
        scales.fill_(COLD_SCALE)
        for i in range(n):
            buf[i, :weights].copy_(proto[i: i + weights])
        return buf, [buf[i] for i in range(n)]
    E = 3 * intermediate * hidden
    proto = (torch.randn(E + n) * 0.02).to(dtype)
    buf = torch.empty(n, E, dtype=dtype, pin_memory=pin)
    for i in range(n):
        buf[i].copy_(proto[i : i + E])
    return buf, [buf[i] for i in range(n)]


def call_overhead(kernel: CpuExpertKernel, hidden: int, intermediate: int, dtype=torch.bfloat16, jobs: int = 8,
                  repeats: int = 15, gap_s: float = 0.002, held: bool = True, expert_dtype: str = "bf16") -> float:
    """Fixed seconds per kernel call (waking the workers and joining them), from one-token calls over 1 and over
    `jobs` experts: t(n) = call + n * expert, so call = t(1) - (t(jobs) - t(1)) / (jobs - 1). Warm weights: the
    difference takes the per-expert time out whatever it is. Each call comes `gap_s` after the previous one, as
    the engine's calls come once per layer. The engine wakes the workers before each call (`hold`), and so does this
    measurement unless held=False: then the workers have gone to sleep and each call pays their wake-up. dtype: the
    tokens'; expert_dtype: the blobs' (make_cold_blobs)."""
    _buf, blobs = make_cold_blobs(hidden, intermediate, jobs, dtype, expert_dtype=expert_dtype)
    x = torch.randn(jobs, hidden).to(dtype)
    out = torch.empty(jobs, hidden, dtype=torch.float32)
    kernel.hold(60.0 if held else 0.0)
    try:
        median = _call_times(kernel, x, out, blobs, intermediate, jobs, repeats, gap_s)
    finally:
        kernel.hold(0.0)
    return max(median[1] - (median[jobs] - median[1]) / (jobs - 1), 0.0)


def _call_times(kernel, x, out, blobs, intermediate, jobs, repeats, gap_s) -> dict[int, float]:
    median = {}
    for n in (1, jobs):
        tok, offs = torch.arange(n, dtype=torch.int64), torch.arange(n + 1, dtype=torch.int64)
        times = []
        for rep in range(repeats + 1):   # the first call warms up code, scratch and weights
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            kernel.run(x[:n], tok, offs, blobs[:n], intermediate, out[:n])
            if rep:
                times.append(time.perf_counter() - t0)
        median[n] = sorted(times)[len(times) // 2]
    return median


def calibrate(kernel: CpuExpertKernel, hidden: int, intermediate: int, token_counts=(1, 2, 4, 8, 16, 32),
              dtype=torch.bfloat16, n_experts: int = 64, repeats: int = 5, jobs_per_call: int = 8,
              expert_dtype: str = "bf16") -> dict[int, float]:
    """Median seconds per expert for each token count, with cold weights, for the runtime's cost model.

    Allocates at least n_experts blobs and enough to exceed ~2.5x the L3, cycles through them, and times calls of
    `jobs_per_call` experts with the same number of tokens each. dtype: the tokens'; expert_dtype: the blobs'.
    """
    _buf, blobs = make_cold_blobs(hidden, intermediate, 1, dtype, expert_dtype=expert_dtype)
    esize = blobs[0].numel() * blobs[0].element_size()
    n = max(n_experts, math.ceil(2.5 * l3_bytes() / esize) + jobs_per_call, 2 * jobs_per_call)
    _buf, blobs = make_cold_blobs(hidden, intermediate, n, dtype, expert_dtype=expert_dtype)
    result: dict[int, float] = {}
    cursor = 0
    for nt in token_counts:
        P = nt * jobs_per_call
        x = torch.randn(P, hidden).to(dtype)
        tok = torch.arange(P, dtype=torch.int64)
        offs = torch.arange(0, P + 1, nt, dtype=torch.int64)
        out = torch.empty(P, hidden, dtype=torch.float32)
        times = []
        for rep in range(repeats + 1):  # the first call warms up code and scratch
            if cursor + jobs_per_call > n:
                cursor = 0
            bl = blobs[cursor : cursor + jobs_per_call]
            cursor += jobs_per_call
            t0 = time.perf_counter()
            kernel.run(x, tok, offs, bl, intermediate, out)
            dt = time.perf_counter() - t0
            if rep:
                times.append(dt / jobs_per_call)
        times.sort()
        result[nt] = times[len(times) // 2]
    return result
