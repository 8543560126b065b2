"""What the decoding side sees of the runtime: one protocol for the loop and the MoE layers, one for the graphs.

ExpertBackend is what the decoding loop tells about each forward and iteration and what every MoE layer calls
(ExpertManager, or for one pass a stand-in that wraps it: a trace recorder, a profiling probe). GraphHooks is what
decoding/graphs.py needs to capture and replay forwards: the path a forward takes (part of a graph's key), the
routing a capture logged (handed back after every replay), and, for a segmented graph, the host round trip's four
parts (LayerSegments) around which the segments end.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import torch

from ..policies.contract import ForwardInfo, IterationEvent


class ExpertBackend(Protocol):
    # ------------------------------------------------------------------- the decoding loop: request and forwards
    def on_request_start(self) -> None: ...

    def overlapped(self) -> AbstractContextManager:
        """A request's forwards: host work may be queued behind the next launch, done on the way out."""

    def begin_forward(self, info: ForwardInfo) -> None:
        """A forward is about to be queued."""

    def launched(self) -> None:
        """The forward is queued: the host work deferred behind it may run."""

    def end_forward(self) -> None:
        """The forward (and the loop's read-back of its prediction) is queued: the host's part after it."""

    def flush(self) -> None:
        """Every piece of host work still queued, done now."""

    def on_iteration(self, event: IterationEvent) -> None: ...

    # ------------------------------------------------------------------------------------- a MoE layer's run
    def shared_ahead(self, x: torch.Tensor, shared):
        """The shared expert to pass to run(), asked for before the layer routes (it may start it already)."""

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared=None
            ) -> torch.Tensor:
        """The layer's routed output [T, H], plus shared(x) when the layer has a shared expert."""


class LayerSegments(Protocol):
    """An offloaded layer in four parts: a segmented graph replays begin and load_wave and runs decide and finish
    eagerly between them (RoundTrip)."""

    def begin(self, layer: int, x, ids, weights, shared=None) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def decide(self, layer: int, x, load_slots: torch.Tensor):
        """Host part one; returns the layer's work, whose `loads_first` says whether load_wave computes anything."""

    def load_wave(self, layer: int, x, load_slots: torch.Tensor, y_pairs: torch.Tensor) -> None: ...

    def finish(self, work, x, y_pairs: torch.Tensor) -> None: ...

    def combine(self, y_pairs: torch.Tensor, weights: torch.Tensor, shared_out=None) -> torch.Tensor: ...


class GraphHooks(Protocol):
    segments: LayerSegments

    def path(self) -> bool:
        """The forward under way takes the mapped path (one segment): part of a graph's key."""

    def capture(self, boundary=None) -> AbstractContextManager:
        """Around a capture: the routing logged inside is taken as the capture's (`.routing` of what it yields) and
        kept for this forward, or dropped if the capture fails; `boundary` (a segmented capture's host steps) is
        called instead of the host round trip's run until the capture ends."""

    def replayed(self, routing: list) -> None:
        """A replay of a capture whose routing is `routing`: logged as the eager forward would have logged it."""
