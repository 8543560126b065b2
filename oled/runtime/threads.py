"""The engine's CPU threads, sized together: torch's intra-op pool and the CPU expert kernel's workers.

Both pools busy-wait between pieces of work (OpenMP barriers, the kernel's spinning workers), so together they must
not ask for more threads than the process has physical cores: a preempted thread then stalls every other one at the
next barrier (docs/decisions.md: cpu-threads).

torch gets one thread by default, the main thread. On a GPU it only launches kernels and issues copies; on a
CPU-only machine it runs attention and the resident experts, where a second thread was no faster on the bundled
model. The remaining physical cores go to the
CPU expert kernel. `--torch-threads` and `--cpu-threads` override either side.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from .cpu_kernel import physical_cpus

TORCH_THREADS_DEFAULT = 1     # the main thread: launches GPU work, or computes on a CPU-only machine
log = logging.getLogger("oled")


@dataclass(frozen=True)
class ThreadPlan:
    torch_threads: int        # torch intra-op threads (torch.set_num_threads)
    kernel_threads: int       # CPU expert kernel workers (used only by policies that compute on the CPU)
    cores: int                # physical cores in this process's CPU set

    def describe(self) -> str:
        return (f"{self.torch_threads} torch thread(s) + {self.kernel_threads} CPU expert thread(s) on "
                f"{self.cores} physical core(s)")


def plan_threads(torch_threads: int | None = None, kernel_threads: int | None = None,
                 cores: int | None = None, usable: int | None = None) -> ThreadPlan:
    """Defaults: one torch thread, the other physical cores (at least one) for the CPU expert kernel. Counts asked
    for are clamped, with one warning line, to the CPUs this process may use (`usable`, its affinity mask; the
    given `cores` when that is given): torch's at most all of them, the kernel's at most the ones torch's leave (at
    least one), since more threads than CPUs only wait on each other."""
    if cores is None:
        cores = len(physical_cpus()[0])
        usable = usable or len(os.sched_getaffinity(0))
    usable = usable or cores
    for name, value in (("torch threads", torch_threads), ("CPU expert threads", kernel_threads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be a whole number, got {value!r}")
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    torch_n = min(torch_threads or TORCH_THREADS_DEFAULT, usable)
    kernel_n = min(kernel_threads, max(1, usable - torch_n)) if kernel_threads else max(1, cores - torch_n)
    clamped = [f"{what} lowered from {asked} to {got}"
               for what, asked, got in (("torch threads (--torch-threads)", torch_threads, torch_n),
                                        ("CPU expert threads (--cpu-threads)", kernel_threads, kernel_n))
               if asked is not None and asked != got]
    if clamped:
        log.warning("warning: %s: this process may use %d CPU(s), and more threads than CPUs only wait on each "
                    "other", ", ".join(clamped), usable)
    return ThreadPlan(torch_n, kernel_n, cores)
