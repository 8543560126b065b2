"""The CPU's share of a mapped forward's misses: which experts the CPU computes inside the forward, by a rule the GPU's
alignment kernel applies to the routing and the host applies to the same routing, so that neither waits for the
other to decide.

A layer of a mapped forward reads its misses (experts without a slot) from host memory over PCIe. With a CPU share
(`EngineConfig.cpu_share`), of the m experts a layer would read, the c = min(table[m], m, demanded - capacity) of
highest id are computed by the CPU expert kernel instead (demanded: the layer's distinct experts; capacity: its
slots; so only misses its slots could not keep), on the layer's input rows, which the alignment stores into pinned
memory before the routing; the GPU reads the rest, then its combine waits for the CPU's rows (oled/kernels/triton_moe.py
`CpuShare`). The table is the planner's objective (planner.py `split_misses`) minimised for m misses of one token
each, with nothing credited, over the cost model's mapped reads (CostModel.mapped_reads: a miss costs the GPU its
read inside the kernels, measured, not a copy): the makespan of the GPU's reads beside the CPU's experts. It depends
on m only, so the kernel needs no host number per forward. Which experts is fixed by id: the capture (the misses the kernels write into
free slots) ranks the GPU's, so the CPU's are never captured, and the loads after the forward take the GPU's misses
first (Residency.decide_mapped), so the CPU's are the ones left out when the slots run out.

Plain NumPy over host numbers: the live manager and the trace replayer call the same functions.
"""
from __future__ import annotations

import numpy as np

from ..policies.contract import PlanInputs
from ..policies.costs import CostModel
from .planner import split_misses


def cpu_share_table(costs: CostModel, num_experts: int, rows: int = 0) -> np.ndarray:
    """[E + 1] int32: for m experts read from host memory, how many the CPU takes (the planner's best split of m
    one-token misses at `rows` input rows, `costs` loading a miss as the GPU would: CostModel.mapped_reads for the
    mapped path; every split of the same count costs the same there)."""
    table = np.zeros(num_experts + 1, dtype=np.int32)
    for m in range(1, num_experts + 1):
        _, cpu = split_misses(PlanInputs(tokens={e: 1 for e in range(m)}, rows=rows), costs)
        table[m] = len(cpu)
    return table


def cpu_share_experts(misses, table: np.ndarray, demanded: int, capacity: int) -> list[int]:
    """The CPU's experts of a layer whose distinct misses are `misses` (any order), `demanded` distinct experts in
    all, `capacity` slots: the c highest ids, in increasing id, c = min(table[m], m, demanded - capacity). Only
    misses the layer's slots cannot keep go to the CPU: the loads after a mapped forward fill the slots not holding
    a hit (capacity - (demanded - m) of them), so any other CPU expert would be copied afterwards anyway, its bytes
    crossing PCIe all the same (docs/decisions.md: cpu-share-off). The alignment kernel's rule
    (oled/kernels/moe_align_kernel.py, CPU_SHARE)."""
    ordered = sorted(misses)
    m = len(ordered)
    c = min(int(table[m]) if m < len(table) else 0, m, max(0, demanded - capacity))
    return ordered[m - c:] if c else []


class ShareHold:
    """Whether the CPU kernel's workers poll through a mapped forward with a CPU share. Polling workers slow the main
    thread's Python (the policy's decisions), so they are held through a forward only if the last mapped forward gave
    the CPU work; in a forward not held, the first layer with a share holds them from then on (that layer's job pays
    their wake-up). At a budget where no layer gives the CPU anything, nothing polls (docs/decisions.md:
    cpu-share-off)."""

    def __init__(self) -> None:
        self.expected = True        # the last mapped forward gave the CPU work (or none ran yet)
        self.held = False           # the workers are held through the current forward
        self._shared = False        # a layer of the current forward gave the CPU work

    def begin(self) -> bool:
        """A mapped forward is queued: True to hold the workers through it."""
        self._shared, self.held = False, self.expected
        return self.held

    def layer(self, cpu: list[int]) -> bool:
        """A layer's share (its CPU experts): True to hold the workers from now on (its job is the forward's first
        and they are not held)."""
        if not cpu:
            return False
        self._shared = True
        if self.held:
            return False
        self.held = True
        return True

    def end(self) -> bool:
        """The forward's decisions are made: True to release a hold."""
        held, self.held, self.expected = self.held, False, self._shared
        return held
