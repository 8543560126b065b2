"""The policy interface: events in, one decision out. A policy is plain Python bookkeeping; it never touches tensors.

The runtime tells a policy what happened, in order, and applies what it returns:
  on_request_start()          a new request starts
  on_forward(info)            a forward starts: its kind and which rows are which canvas positions (ForwardInfo)
  decide(event) -> decision   per MoE layer of the forward: the routing per token (ids and weights [T, k]), the
                              demand, the resident set -> which misses to load, which to compute on the CPU, the
                              eviction order, optional prefetch for the next layer (LayerDecision)
  on_iteration(event)         after a denoising iteration: each block position's state and confidence
The live expert manager and the trace replayer produce the very same events, so a replay reaches the same decisions.
The events and decisions are the contract (policies/contract.py), which depends on nothing of the runtime.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..textfile import read_text
from .contract import (EvictionOrder, ForwardInfo, IterationEvent, LayerDecision, LayerEvent, PlanInputs,
                       PolicyContext, increasing_ids, member_mask)
from .costs import CostModel

__all__ = ["MISS_MODES", "Policy", "read_json", "EvictionOrder", "ForwardInfo", "IterationEvent", "LayerDecision",
           "LayerEvent", "PolicyContext", "increasing_ids", "member_mask"]

MISS_MODES = ("load", "cooperative")   # what a caching policy does with a miss: load it, or let the planner split


class Policy:
    name = "base"
    uses_cpu = False            # the policy may compute misses on the CPU
    static_full = False         # every expert resident, nothing to decide: the manager skips host round trips
    wants_prediction = False    # events carry the next layer's predicted routing
    loads_misses = True         # a decision may load; False (a static placement): the mapped path arms no capture
    needs_future = False        # replay only: the policy is given the trace's future demand (belady)

    def setup(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.costs: CostModel | None = ctx.costs    # what the misses are planned on: plan_on sets it per forward
        self.iteration = 0
        self.block_step = 0

    def plan_on(self, costs: CostModel | None) -> None:
        """The cost table the next forward's misses are planned on (the measured one, its CPU terms scaled by what
        the engine has seen its CPU jobs take): the runtime's one way to change what a policy plans with."""
        self.costs = costs

    def initial_placement(self, layer: int) -> list[int]:
        """Experts to make resident before the first forward (static placements)."""
        return []

    def on_request_start(self) -> None:
        """A new request starts (per-request state resets; learned residency may stay)."""
        self.iteration = 0
        self.block_step = 0

    def on_forward(self, info: ForwardInfo) -> None:
        """A forward starts."""

    def decide(self, event: LayerEvent) -> LayerDecision:
        raise NotImplementedError

    def on_iteration(self, event: IterationEvent) -> None:
        self.iteration = event.iteration + 1
        self.block_step = 0 if event.block_done else event.step + 1

    # ------------------------------------------------------------------------------------- shared helpers
    def cooperative_split(self, event: LayerEvent, credit: dict[int, float] | None = None,
                          evict_loss: list[float] | None = None, waves: bool = False) -> tuple[list[int], list[int]]:
        """Split the misses between loading and the CPU with the planner on the measured costs. Loads fill the free
        slots first (a free slot is never left empty for a miss sent to the CPU). They are capped at the slots not
        holding a hit, so the layer runs in one wave, unless `waves`: then any miss may load, in further waves that
        reuse the slots of experts already computed (the misses of a layer that needs more experts than it has
        slots need not all go to the CPU). evict_loss[i] is the predicted value lost by the i-th eviction a load
        beyond the free slots causes."""
        if event.misses_served:     # nothing to split: load them (most rows first) as lru does
            return sorted(event.misses, key=lambda e: (-event.demand[e], e)), []
        if self.costs is None:
            raise RuntimeError(f"policy {self.name!r}: cooperative miss handling needs the measured cost model")
        if self.ctx.planner is None:
            raise RuntimeError(f"policy {self.name!r}: cooperative miss handling needs a planner in its context")
        hits = event.hits
        misses = {e: event.demand[e] for e in event.misses}
        free = self.ctx.capacity - len(event.resident)
        inputs = PlanInputs(tokens=misses, rows=len(event.ids),
                            free_slots=free, max_loads=None if waves else self.ctx.capacity - len(hits),
                            credit=credit or {},
                            evict_loss=evict_loss or [])
        return self.ctx.planner(inputs, self.costs)


def read_json(path, what: str, hint: str = ""):
    """A policy's data file (JSON), with one clear line for a missing or malformed file."""
    path = Path(path)
    try:
        return json.loads(read_text(path, f"{what} file"))
    except FileNotFoundError:
        raise ValueError(f"{what} file {str(path)!r} not found{hint}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} file {str(path)!r} is not JSON ({e})") from None
