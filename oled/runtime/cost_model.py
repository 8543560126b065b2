"""The cost table's measurement (oled/policies/costs.py holds the table itself): what loading an expert and
computing one on the CPU take on this machine.

Nothing here is a constant: H2D bandwidth is timed with the store's own pinned blobs, CPU time per expert comes
from the CPU kernel's `calibrate()` (cold weights, per tokens-per-expert), and the CPU slowdown while copies run
(both read host DRAM) is timed too. Results are cached per machine and shape under ~/.cache/oled/costs/.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import threading
import time
from pathlib import Path

import torch

from ..policies.costs import CostModel
from .cpu_calibration import calibrate, call_overhead, make_cold_blobs
from .cpu_kernel import l3_bytes
from .grouped import grouped_swiglu

log = logging.getLogger("oled")

COST_MODEL_VERSION = 12  # part of the cache key: a model measured by older code is measured again


def _time_copies(store, device, n: int, min_rounds: int = 5, min_seconds: float = 0.05) -> float:
    """Seconds to copy n expert blobs from the store into device memory, one copy per blob as the manager issues them,
    the blobs taken from every layer in turn (expert i // L of layer i % L), as the engine loads from all of them (a
    guard against a layer unlike the rest). The least of at least min_rounds rounds and min_seconds of copying, after
    one round untimed. On the GPU each round is timed with CUDA events around copies queued behind a short GPU wait,
    so that the time is the copy engine's and not the host's (host-clocked rounds without a warm-up read some
    processes' copy rate at half its value)."""
    layers, experts = store.layers, store.config.num_experts
    n = min(n, len(layers) * experts)
    blobs = [store.blob(layers[i % len(layers)], i // len(layers)) for i in range(n)]
    dst = torch.empty(n, store.numel, dtype=store.blob_dtype, device=device)
    cuda = torch.device(device).type == "cuda"

    def one_round() -> float:
        if not cuda:
            t0 = time.perf_counter()
            for i in range(n):
                dst[i].copy_(blobs[i])
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_QUEUE_CYCLES)      # the copies below are all queued before the start event is reached
        start.record()
        for i in range(n):
            dst[i].copy_(blobs[i], non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    one_round()
    times: list[float] = []
    while len(times) < min_rounds or (sum(times) < min_seconds and len(times) < 100):
        times.append(one_round())
    return min(times)


_QUEUE_CYCLES = 2_000_000     # GPU clock cycles (about a millisecond): longer than queueing one round's copies


def h2d_gbps(store, device, n: int | None = None) -> float:
    """GB/s of expert blob copies from the store into device memory, n blobs a batch (the copy path's bandwidth;
    default: two from every layer, at least 16)."""
    n = min(n or max(16, 2 * len(store.layers)), len(store.layers) * store.config.num_experts)
    return n * store.expert_bytes / _time_copies(store, device, n) / 1e9


def _time_grouped(store, device, tokens: int, n_experts: int = 16, repeats: int = 20, rounds: int = 3) -> float:
    """Seconds per expert of the grouped SwiGLU over a slot pool (the GPU side of a layer), `tokens` tokens per
    expert. On the GPU the call is captured in a CUDA graph and its replays are timed (_replay_seconds): the engine
    replays it in a graph, and timing eager calls measures the host's launches instead."""

    layer, n = store.layers[0], min(n_experts, store.config.num_experts)
    pool = torch.stack([store.blob(layer, e) for e in range(n)]).to(device)
    x = torch.randn(n * tokens, store.hidden, device=device).to(store.dtype)
    pair_tokens = torch.arange(n * tokens, device=device)
    pair_slots = torch.arange(n, device=device).repeat_interleave(tokens)

    # FP8 experts on the GPU: the fused kernels, which dequantise in their GEMMs (grouped_swiglu copies the pool
    # dequantised first)
    fused = _fused_swiglu() if store.fp8 and torch.device(device).type == "cuda" else None
    out = torch.empty(pair_slots.shape[0], store.hidden, dtype=store.dtype, device=device)

    def call():
        if fused is not None:
            fused(x, pair_slots, pool, store.hidden, store.intermediate, out)
        else:
            grouped_swiglu(x, pair_tokens, pair_slots, pool, store.hidden, store.intermediate)

    if torch.device(device).type != "cuda":
        call()                                  # warms up
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2] / n
    return _replay_seconds(call, device, repeats, rounds) / n


def _replay_seconds(call, device, repeats: int, rounds: int) -> float:
    """Seconds of one call on the GPU: captured in a CUDA graph (after two warm-up calls on a side stream, as capture
    requires), its replays timed with CUDA events, the median of `rounds` rounds of `repeats` back-to-back replays."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        call()
        call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / repeats)
    del graph
    return sorted(times)[len(times) // 2]


def _fused_swiglu():
    """The fused MoE kernels' entry point, None without Triton (an optional dependency)."""
    try:
        from ..kernels.triton_moe import fused_swiglu_pairs
    except ImportError:
        return None
    return fused_swiglu_pairs


def _time_mapped_read(store, device, n: int = 8, repeats: int = 10, rounds: int = 3) -> float:
    """Seconds a miss adds to the fused MoE kernels that read it from the store's pinned blobs (the mapped path, one
    token an expert): the kernels over 2n such experts less over n, per expert, each timed by graph replays
    (_replay_seconds). The difference leaves out the launches and a call's fixed time, which the layer's hits pay
    anyway; 0.0 where the kernels cannot read host memory (no CUDA, unpinned blobs, no Triton). The same experts
    are read at every replay: an expert small enough stays in the GPU's L2 between them, as it would between the
    engine's forwards."""
    if torch.device(device).type != "cuda" or not store.pinned:
        return 0.0
    fused_swiglu_pairs = _fused_swiglu()
    if fused_swiglu_pairs is None:
        return 0.0
    n = max(1, min(n, store.config.num_experts // 2))
    pool = torch.empty(1, store.numel, dtype=store.blob_dtype, device=device)   # no pair reads it

    def seconds(m: int) -> float:
        x = torch.randn(m, store.hidden, device=device).to(store.dtype)
        pair_slots = torch.arange(1, m + 1, device=device)      # slot 1 + e: expert e's blob in host memory
        out = torch.empty(m, store.hidden, dtype=store.dtype, device=device)
        return _replay_seconds(lambda: fused_swiglu_pairs(x, pair_slots, pool, store.hidden, store.intermediate,
                                                          out, host=store.blobs[0]), device, repeats, rounds)

    return max(0.0, (seconds(2 * n) - seconds(n)) / n)


def _time_transfer(store, device, rows: int, pairs: int, repeats: int = 9) -> float:
    """Seconds of a layer's activation round trip to the CPU path as the manager makes it: the input rows to a
    pinned host buffer, the pairs' fp32 outputs back (median)."""
    cuda = torch.device(device).type == "cuda"
    x = torch.randn(rows, store.hidden, device=device).to(store.dtype)
    x_host = torch.empty(rows, store.hidden, dtype=store.dtype, pin_memory=cuda)
    out_host = torch.empty(pairs, store.hidden, dtype=torch.float32, pin_memory=cuda)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x_host.copy_(x)
        y = out_host.to(device, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        del y
    return sorted(times)[len(times) // 2]


class _CopyLoad:
    """Copies of expert blobs queued on a side stream, enough to outlast the CPU work timed beside them: what the copy
    engine does while the CPU kernel runs, with no host thread launching them (the engine queues its copies and goes
    on). A thread that launched copies in rounds competed with the kernel's workers for the host's cores and made the
    CPU's slowdown beside copies a measure of that contention instead. `outlasted` says whether the
    copies were still running when the CPU work ended (otherwise part of it ran alone)."""

    def __init__(self, store, device, h2d_gbps: float, seconds: float):
        m = max(1, min(store.config.num_experts, 2**30 // store.expert_bytes))     # at most 1 GiB per copy
        self.sources = [b[:m] for b in store.blobs]
        self.copies = max(1, math.ceil(seconds * h2d_gbps * 1e9 / (m * store.expert_bytes)))
        self.dst = torch.empty_like(self.sources[0], device=device)
        self.stream = torch.cuda.Stream(device)
        self.done = torch.cuda.Event()
        self.outlasted = False

    def __enter__(self):
        torch.cuda.synchronize(self.dst.device)
        with torch.cuda.stream(self.stream):
            for i in range(self.copies):
                self.dst.copy_(self.sources[i % len(self.sources)], non_blocking=True)
            self.done.record(self.stream)
        return self

    def __exit__(self, *exc):
        self.outlasted = not self.done.query()
        self.done.synchronize()
        return False


def _cpu_slowdown_with_copies(store, kernel, device, h2d: float, alone_s: float, jobs: int) -> float:
    """The CPU kernel's time per expert (4 tokens, cold weights) while copies stream, over `alone_s`: the least of
    ROUNDS rounds, each under copies that outlast it (their length doubled until they do)."""
    if not store.pinned:           # unpinned copies block the host: they never overlap the CPU kernel
        return 1.0
    seconds, busy = 0.5, []
    while len(busy) < ROUNDS and seconds <= 8.0:
        with _CopyLoad(store, device, h2d, seconds) as load:
            t = calibrate(kernel, store.hidden, store.intermediate, (4,), dtype=store.dtype, repeats=3,
                          jobs_per_call=jobs, expert_dtype=store.expert_dtype)[4]
        if load.outlasted:
            busy.append(t)
        else:
            seconds *= 2
    if not busy:
        log.warning("cost model: copies never outlasted the CPU kernel's timing; CPU slowdown while copying taken "
                    "as 1.0")
        return 1.0
    return max(1.0, min(busy) / alone_s)


def _copy_slowdown_with_cpu(store, kernel, device, jobs: int, tokens: int = 4) -> float:
    """H2D copy time while the CPU kernel runs back-to-back calls over cold experts in a thread, over the time
    alone. The kernel's weights are made before the copies are timed, so what overlaps them is the kernel's reads."""
    n = 16
    alone = _time_copies(store, device, n)
    esize = store.expert_bytes
    count = max(2 * jobs, math.ceil(2.5 * l3_bytes() / esize) + jobs)
    _buf, blobs = make_cold_blobs(store.hidden, store.intermediate, count, store.dtype,
                                  expert_dtype=store.expert_dtype)
    P = tokens * jobs
    x = torch.randn(P, store.hidden).to(store.dtype)
    tok, offs = torch.arange(P, dtype=torch.int64), torch.arange(0, P + 1, tokens, dtype=torch.int64)
    out = torch.empty(P, store.hidden, dtype=torch.float32)
    stop, running = threading.Event(), threading.Event()

    def cpu_load():
        cursor = 0
        while not stop.is_set():
            cursor = 0 if cursor + jobs > count else cursor
            kernel.run(x, tok, offs, blobs[cursor:cursor + jobs], store.intermediate, out)
            cursor += jobs
            running.set()

    t = threading.Thread(target=cpu_load, daemon=True)
    t.start()
    try:
        running.wait(timeout=5.0)
        busy = _time_copies(store, device, n)
    finally:
        stop.set()
        t.join()
    return max(1.0, busy / alone)


ROUNDS = 3   # each CPU figure is the least of this many rounds: other work on the machine only ever adds time


def monotone_in_tokens(table: dict[int, float]) -> dict[int, float]:
    """Per-expert times that never fall as tokens grow: a figure above one measured at more tokens is noise (an
    expert's weights are read whatever its tokens), so it is lowered to that one."""
    out, low = {}, float("inf")
    for t in sorted(table, reverse=True):
        low = min(low, table[t])
        out[t] = low
    return dict(sorted(out.items()))


def _copy_rate_of_two(first: float, last: float) -> float:
    """The copy rate measured at the start and at the end of the measurement, seconds apart: the faster, since other
    work on the machine only ever slows copies (some processes read a much lower rate at the start, for a cause
    not found); a reading that moved is said once."""
    if max(first, last) > 1.2 * min(first, last):
        log.warning("cost model: the copy rate read %.1f GB/s at the start of the measurement and %.1f at its end; "
                    "the faster is kept", first, last)
    return max(first, last)


def measure(store, kernel, device, token_counts=(1, 2, 4, 8, 16, 32)) -> CostModel:
    h2d_first = h2d_gbps(store, device)
    # calibrate() times back-to-back calls of 8 experts: take that call's share out of its per-expert times; the
    # engine calls the kernel once per layer, ms apart, after waking the workers (manager.py, EngineConfig.cpu_wake): the
    # time of such a call is the model's
    jobs = 8
    args = (kernel, store.hidden, store.intermediate)
    blobs = dict(dtype=store.dtype, expert_dtype=store.expert_dtype)
    back_to_back = min(call_overhead(*args, jobs=jobs, gap_s=0.0, **blobs) for _ in range(ROUNDS))
    call = min(call_overhead(*args, jobs=jobs, **blobs) for _ in range(ROUNDS))
    rounds = [calibrate(*args, token_counts, jobs_per_call=jobs, **blobs) for _ in range(ROUNDS)]
    cpu = monotone_in_tokens({t: max(s - back_to_back / jobs, 0.1 * s)
                              for t, s in ((t, min(r[t] for r in rounds)) for t in token_counts)})
    gpu = {t: _time_grouped(store, device, t) for t in token_counts}
    mapped = _time_mapped_read(store, device)
    h2d = _copy_rate_of_two(h2d_first, h2d_gbps(store, device))
    rows, pairs = store.config.block_length, store.config.block_length * store.config.top_k
    row_bytes = store.hidden * torch.empty((), dtype=store.dtype).element_size()
    # the fixed part: the measured round trip less its bytes over the copy bandwidth (which the model adds per use)
    transfer = max(0.0, _time_transfer(store, device, rows, pairs)
                   - (rows * row_bytes + pairs * store.hidden * 4) / (h2d * 1e9))
    cpu_slowdown = copy_slowdown = 1.0
    if torch.device(device).type == "cuda":   # CPU kernel and copies side by side: both read host DRAM
        cpu_slowdown = _cpu_slowdown_with_copies(store, kernel, device, h2d, cpu[4] + back_to_back / jobs, jobs)
        copy_slowdown = min(_copy_slowdown_with_cpu(store, kernel, device, jobs) for _ in range(ROUNDS))
    return CostModel(expert_bytes=store.expert_bytes, h2d_gbps=h2d, cpu_seconds=cpu, cpu_call_seconds=call,
                     cpu_slowdown_with_copies=cpu_slowdown, gpu_seconds=gpu, copy_slowdown_with_cpu=copy_slowdown,
                     transfer_seconds=transfer, row_bytes=row_bytes, pair_bytes=store.hidden * 4,
                     mapped_seconds=mapped, source=f"measured {time.strftime('%Y-%m-%d')}")


def cache_key(store, kernel, device) -> str:
    dev = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    text = "|".join(map(str, (COST_MODEL_VERSION, platform.processor(), platform.machine(), os.cpu_count(),
                              kernel.name, kernel.num_threads, sorted(getattr(kernel, "knobs", {}).items()),
                              store.hidden, store.intermediate, store.dtype,
                              store.pinned, dev) + ((store.expert_dtype,) if store.fp8 else ())))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_or_measure(store, kernel, device, cache_dir: str | Path | None = None) -> CostModel:
    """The cached cost model for this machine and shape, measured on first use."""
    root = Path(cache_dir or os.environ.get("OLED_COST_CACHE") or Path.home() / ".cache" / "oled" / "costs")
    path = root / f"{cache_key(store, kernel, device)}.json"
    if path.is_file():
        try:
            return CostModel.from_json(path.read_text())
        except ValueError:
            pass       # a damaged cache file is measured again and overwritten
    model = measure(store, kernel, device)
    try:
        root.mkdir(parents=True, exist_ok=True)
        path.write_text(model.to_json())
    except OSError:
        pass   # a read-only home only costs a re-measurement next time
    return model
