"""The cost model of miss service: what loading an expert and computing one on the CPU take on this machine.

Nothing here is a constant: H2D bandwidth is timed with the store's own pinned blobs, CPU time per expert comes
from the CPU kernel's `calibrate()` (cold weights, per tokens-per-expert), and the CPU slowdown while copies run
(both read host DRAM) is timed too. Results are cached per machine and shape under ~/.cache/oled/costs/.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch


COST_MODEL_VERSION = 5   # part of the cache key: a model measured by older code is measured again


@dataclass
class CostModel:
    expert_bytes: int
    h2d_gbps: float                       # expert blob copies into cache slots, GB/s
    cpu_seconds: dict[int, float]         # tokens per expert -> seconds per expert (CPU kernel, cold weights)
    cpu_call_seconds: float = 0.0         # fixed time of one kernel call (starting and joining its threads)
    cpu_slowdown_with_copies: float = 1.0  # CPU time factor while H2D copies run concurrently
    gpu_seconds_per_expert: float = 0.0   # grouped GPU compute per resident expert (small; read from HBM)
    source: str = "measured"

    def load_seconds(self, n_experts: int) -> float:
        return n_experts * self.expert_bytes / (self.h2d_gbps * 1e9)

    def cpu_expert_seconds(self, tokens: int) -> float:
        """Per-expert CPU time for `tokens` tokens, interpolated linearly between calibrated token counts."""
        keys = self._token_counts
        if tokens <= keys[0]:
            return self.cpu_seconds[keys[0]]
        if tokens >= keys[-1]:
            return self.cpu_seconds[keys[-1]] * tokens / keys[-1]
        i = bisect.bisect_left(keys, tokens)
        lo, hi = keys[i - 1], keys[i]
        f = (tokens - lo) / (hi - lo)
        return self.cpu_seconds[lo] * (1 - f) + self.cpu_seconds[hi] * f

    @cached_property
    def _token_counts(self) -> list[int]:     # sorted once: the manager asks for every CPU job of every layer
        return sorted(self.cpu_seconds)

    def cpu_jobs_seconds(self, tokens) -> float:
        """One kernel call over experts with these token counts (0 for none)."""
        tokens = list(tokens)
        return self.cpu_call_seconds + sum(map(self.cpu_expert_seconds, tokens)) if tokens else 0.0

    def describe(self) -> str:
        cpu = ", ".join(f"{self.cpu_seconds[t] * 1e6:.0f}" for t in sorted(self.cpu_seconds))
        return (f"load {self.load_seconds(1) * 1e6:.0f} µs/expert ({self.h2d_gbps:.1f} GB/s); CPU {cpu} µs/expert at "
                f"{'/'.join(map(str, sorted(self.cpu_seconds)))} tokens + {self.cpu_call_seconds * 1e6:.0f} µs per "
                f"call, x{self.cpu_slowdown_with_copies:.2f} while copying ({self.source})")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu_seconds"] = {str(k): v for k, v in self.cpu_seconds.items()}   # JSON object keys
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        try:
            model = cls(**dict(d, cpu_seconds={int(k): float(v) for k, v in d["cpu_seconds"].items()}))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed cost model ({type(e).__name__}: {e})") from None
        if not model.cpu_seconds:
            raise ValueError("malformed cost model: no CPU times")
        return model

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed cost model: not JSON ({e})") from None
        return cls.from_dict(d)


def _time_copies(store, device, n: int) -> float:
    """Seconds to copy n expert blobs from the store into device memory (one batch, as the manager issues them)."""
    layer = store.layers[0]
    n = min(n, store.config.num_experts)
    dst = torch.empty(n, store.numel, dtype=store.dtype, device=device)
    cuda = torch.device(device).type == "cuda"
    best = float("inf")
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for i in range(n):
            dst[i].copy_(store.blob(layer, i), non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(store, kernel, device, token_counts=(1, 2, 4, 8, 16, 32)) -> CostModel:
    from .cpu_kernel import calibrate, call_overhead

    n = 16
    h2d = n * store.expert_bytes / _time_copies(store, device, n) / 1e9
    # calibrate() times back-to-back calls of 8 experts: take that call's share out of its per-expert times; the
    # engine calls the kernel once per layer, ms apart, after waking the workers (manager.py, OLED_CPU_WAKE): the
    # time of such a call is the model's
    jobs = 8
    back_to_back = call_overhead(kernel, store.hidden, store.intermediate, dtype=store.dtype, jobs=jobs, gap_s=0.0)
    call = call_overhead(kernel, store.hidden, store.intermediate, dtype=store.dtype, jobs=jobs)
    cpu = {t: max(s - back_to_back / jobs, 0.1 * s)
           for t, s in calibrate(kernel, store.hidden, store.intermediate, token_counts, dtype=store.dtype,
                                 jobs_per_call=jobs).items()}
    slowdown = 1.0
    if torch.device(device).type == "cuda":   # CPU kernel while copies stream: both read host DRAM
        import threading

        stop = threading.Event()
        # Whole layers of experts per copy, enough layers for a few ms per round, then a blocking wait: the thread
        # sleeps while the copies run and takes the GIL only to launch a handful of them, so what is timed is the
        # DRAM both read, not this thread's Python (many small launches held the GIL: x37 with 48 KiB experts).
        m = max(1, min(store.config.num_experts, 2**30 // store.expert_bytes))     # at most 1 GiB per copy
        rounds = max(1, min(len(store.blobs), math.ceil(0.005 * h2d * 1e9 / (m * store.expert_bytes))))
        sources = [b[:m] for b in store.blobs[:rounds]]
        dst = torch.empty_like(sources[0], device=device)
        stream = torch.cuda.Stream(device)

        def copies():
            while not stop.is_set():
                with torch.cuda.stream(stream):
                    for src in sources:
                        dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event(blocking=True)
                done.record(stream)
                done.synchronize()

        t = threading.Thread(target=copies, daemon=True)
        t.start()
        busy = calibrate(kernel, store.hidden, store.intermediate, (4,), dtype=store.dtype, repeats=3,
                         jobs_per_call=jobs)
        stop.set()
        t.join()
        slowdown = max(1.0, busy[4] / (cpu[4] + back_to_back / jobs))    # both with the call's share
    return CostModel(expert_bytes=store.expert_bytes, h2d_gbps=h2d, cpu_seconds=cpu, cpu_call_seconds=call,
                     cpu_slowdown_with_copies=slowdown, source=f"measured {time.strftime('%Y-%m-%d')}")


def cache_key(store, kernel, device) -> str:
    dev = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    text = "|".join(map(str, (COST_MODEL_VERSION, platform.processor(), platform.machine(), os.cpu_count(),
                              kernel.name, kernel.num_threads, store.hidden, store.intermediate, store.dtype,
                              store.pinned, dev)))
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
