"""Section timing without host syncs in the hot loop: CUDA events on the GPU, perf_counter on the CPU."""
from __future__ import annotations

import time
from collections import defaultdict

import torch


class SectionTimer:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.pending: list = []
        self.totals: dict[str, float] = defaultdict(float)

    def __call__(self, name: str):
        return _Section(self, name)

    def collect(self) -> dict[str, float]:
        """Seconds per section since the last collect (synchronises the device once)."""
        if self.cuda and self.pending:
            self.pending[-1][2].synchronize()
        out: dict[str, float] = defaultdict(float)
        for name, start, end in self.pending:
            out[name] += start.elapsed_time(end) / 1e3 if self.cuda else end - start
        self.pending.clear()
        for k, v in out.items():
            self.totals[k] += v
        return dict(out)


class _Section:
    __slots__ = ("timer", "name", "start")

    def __init__(self, timer: SectionTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self):
        if self.timer.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.timer.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self.timer.pending.append((self.name, self.start, end))
        return False


class Sections:
    """The runtime's named sections, timed by `timer` when one is set (a profiled run sets it, and may unset it),
    else free: every part of the manager times through the one instance."""

    def __init__(self, timer: SectionTimer | None = None):
        self.timer = timer

    def __call__(self, name: str):
        return self.timer(name) if self.timer is not None else _NULL


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()
