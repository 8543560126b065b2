"""`tide`: periodic re-placement of each layer's resident set; misses between refreshes run on the CPU.

A refresh happens at every forward of a block's first iteration and then every `tau` iterations within the block
(block_step % tau == 0; Policy.on_iteration keeps block_step, 0 at a block's first iteration, so forwards that run
before it, the prompt prefill and a finished block's cache fill, refresh too). At a refresh, per layer:
  desired = the `capacity` experts with the most tokens in this forward (ties: lower expert id);
  load    = the desired experts that are not resident (most tokens first): promoted;
  cpu     = the other misses;
each load that finds no free slot evicts the resident expert outside `desired` with the fewest tokens in this
forward (ties: lower id), so no more experts are demoted than promoted and a desired expert is never pushed out.
Between refreshes nothing moves: every miss runs on the CPU.
"""
from __future__ import annotations

from .base import EvictionOrder, LayerDecision, Policy


class TidePolicy(Policy):
    name = "tide"
    uses_cpu = True
    options = ("tau",)

    def __init__(self, tau: int = 4):
        if isinstance(tau, bool) or int(tau) != tau or int(tau) < 1:
            raise ValueError(f"policy 'tide': tau (the refresh period in iterations) must be a positive integer, "
                             f"got {tau!r}")
        self.tau = int(tau)

    def setup(self, ctx):
        super().setup(ctx)
        self.refreshes = {layer: 0 for layer in ctx.layers}     # refreshes done per layer (for reports and tests)

    def refresh_due(self) -> bool:
        return self.block_step % self.tau == 0

    def decide(self, event):
        misses, demand = event.misses, event.demand
        if not self.refresh_due():
            return LayerDecision(cpu=misses)       # nothing moves between refreshes
        desired = sorted(demand, key=lambda e: (-demand[e], e))[: self.ctx.capacity]
        keep = set(desired)
        self.refreshes[event.layer] += 1
        load = [e for e in desired if e not in event.resident]
        demoted = event.resident - keep
        return LayerDecision(load=load, cpu=[e for e in misses if e not in keep],
                             evict=EvictionOrder(lambda: sorted(demoted, key=lambda e: (demand.get(e, 0), e))))
