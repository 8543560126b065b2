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

from dataclasses import dataclass

from .cpu_kernel import physical_cpus

TORCH_THREADS_DEFAULT = 1     # the main thread: launches GPU work, or computes on a CPU-only machine


@dataclass(frozen=True)
class ThreadPlan:
    torch_threads: int        # torch intra-op threads (torch.set_num_threads)
    kernel_threads: int       # CPU expert kernel workers (used only by policies that compute on the CPU)
    cores: int                # physical cores in this process's CPU set

    def describe(self) -> str:
        return (f"{self.torch_threads} torch thread(s) + {self.kernel_threads} CPU expert thread(s) on "
                f"{self.cores} physical core(s)")


def plan_threads(torch_threads: int | None = None, kernel_threads: int | None = None,
                 cores: int | None = None) -> ThreadPlan:
    """Defaults: one torch thread, the other physical cores (at least one) for the CPU expert kernel."""
    if cores is None:
        cores = len(physical_cpus()[0])
    for name, value in (("torch threads", torch_threads), ("CPU expert threads", kernel_threads)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    torch_n = torch_threads or TORCH_THREADS_DEFAULT
    return ThreadPlan(torch_n, kernel_threads or max(1, cores - torch_n), cores)
