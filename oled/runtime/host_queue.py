"""Host work queued behind the next launch.

On the one-graph paths nothing in a forward waits for the host, so the host's share of a forward (its start, its
routing's statistics, the policy's iteration event) can wait until the loop has queued the next forward, and run
while the GPU runs it: in order, one forward late. `overlap` is set for a request's forwards on the all-resident
path (ExpertManager.overlapped); the mapped path defers its bookkeeping whatever it is.
"""
from __future__ import annotations

from collections.abc import Callable


class HostQueue:
    def __init__(self) -> None:
        self.overlap = False                      # inside ExpertManager.overlapped() on the all-resident path
        self.deferred: list[tuple[Callable, object]] = []

    def defer(self, work: Callable, arg) -> None:
        self.deferred.append((work, arg))

    def flush(self) -> None:
        deferred, self.deferred = self.deferred, []
        for work, arg in deferred:
            work(arg)
