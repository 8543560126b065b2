"""The policy interface. A policy is plain Python bookkeeping: it never touches tensors or weights.

The expert manager calls, per MoE layer and iteration:
  plan(layer, demand, resident)  -> which misses to load onto the GPU and which to compute on the CPU
  victim(layer, candidates)      -> whenever a slot is needed and none is free
  prefetch(layer, predicted, resident) -> optional speculative loads for the next layer
and once per denoising iteration on_iteration(event) with the token states and confidences.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..runtime.cost_model import CostModel
from ..runtime.planner import split_misses

MISS_MODES = ("load", "cooperative")   # what a caching policy does with a miss: load it, or let the planner split


@dataclass
class LayerPlan:
    load: list[int] = field(default_factory=list)   # misses copied to the GPU, in priority order
    cpu: list[int] = field(default_factory=list)    # misses computed on the CPU (only activations cross PCIe)


@dataclass
class PolicyContext:
    layers: list[int]          # MoE layer indices
    num_experts: int
    capacity: int              # slots per layer
    top_k: int
    expert_bytes: int
    costs: CostModel | None = None   # measured miss-service costs (given when the policy computes on the CPU)


@dataclass
class IterationEvent:
    """What the decoding loop tells the runtime after each denoising iteration (host data only)."""
    block: int                       # Block.index (decoding/procedure.py: counted from 0 or the prompt end)
    step: int                        # iteration within the block (0 = the block's first)
    iteration: int                   # global iteration counter of the request
    state: np.ndarray                # per block position: 0 decoded earlier, 1 still masked, 2 committed now
    confidence: np.ndarray           # per block position: confidence of the prediction (-inf where not masked)
    block_done: bool                 # the block has no mask left

    DECODED, MASKED, COMMITTED = 0, 1, 2


class Policy:
    name = "base"
    uses_cpu = False            # the policy may compute misses on the CPU
    static_full = False         # every expert resident, nothing to decide: the manager skips host round trips
    wants_prediction = False    # call prefetch() with the next layer's predicted routing

    def setup(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.iteration = 0
        self.block_step = 0

    def initial_placement(self, layer: int) -> list[int]:
        """Experts to make resident before the first forward (static placements)."""
        return []

    def plan(self, layer: int, demand: dict[int, int], resident: set[int]) -> LayerPlan:
        """demand: expert -> number of tokens routed to it in this forward. Default: load every miss."""
        return LayerPlan(load=[e for e in demand if e not in resident])

    def cooperative_plan(self, demand: dict[int, int], resident: set[int],
                         credit: dict[int, float] | None = None) -> LayerPlan:
        """Split the misses between loading and the CPU with the planner, on the measured costs; loads are capped
        at the slots not holding a hit, so that the layer runs in one wave."""
        if self.ctx.costs is None:
            raise RuntimeError(f"policy {self.name!r}: cooperative miss handling needs the measured cost model")
        misses = {e: n for e, n in demand.items() if e not in resident}
        hits = len(demand) - len(misses)
        load, cpu = split_misses(misses, hits, self.ctx.costs, credit, max_loads=self.ctx.capacity - hits)
        return LayerPlan(load=load, cpu=cpu)

    def victim(self, layer: int, candidates: list[int]) -> int:
        raise NotImplementedError

    def on_access(self, layer: int, demand: dict[int, int]) -> None:
        """After a layer ran: every expert in demand was used (on the GPU or the CPU)."""

    def prefetch(self, layer: int, predicted: dict[int, int], resident: set[int]) -> list[int]:
        return []

    def on_iteration(self, event: IterationEvent) -> None:
        self.iteration = event.iteration + 1
        self.block_step = 0 if event.block_done else event.step + 1

    def on_request_start(self) -> None:
        """A new request starts (per-request state resets; learned residency may stay)."""
        self.iteration = 0
        self.block_step = 0
