"""The all-resident path: every expert resident for good (`full`, or any policy at a budget that holds them all).

There is nothing to decide and no host round trip: a layer computes every pair from its slots and logs its
routing on the device; the forward is one graph. Once the forward ends the ids of every layer come back in one
device-to-host copy and are recorded as statistics (inside `overlapped()` once the next forward is queued). The
policy hears of nothing: with every expert resident for good it has nothing to decide.
"""
from __future__ import annotations

import torch

from .compute import ExpertCompute
from .device_state import Staging
from .host_queue import HostQueue
from .residency import Residency


class ResidentPath:
    def __init__(self, residency: Residency, compute: ExpertCompute, staging: Staging, queue: HostQueue,
                 routing_log: list, cuda: bool):
        """routing_log: the forward's (layer, ids) kept on device until it ends (shared with the graph hooks,
        which hand a replay's routing back into it)."""
        self.residency, self.compute, self.staging, self.queue = residency, compute, staging, queue
        self.routing_log, self.cuda = routing_log, cuda

    def begin_forward(self, info) -> None:
        self.residency.begin_resident_forward(info)

    def run(self, layer, x, ids, weights, shared=None):
        y_pairs, shared_out = self.compute.grouped_all(layer, x, ids, shared)     # every expert resident: one wave
        self.routing_log.append((layer, ids))
        return self.compute.combine(y_pairs, weights, shared_out)

    def end_forward(self) -> None:
        """Record the logged routing: one device-to-host copy of the ids per forward, into a pinned buffer; inside
        `overlapped()` it is recorded once the next forward is queued (the copy is ordered before that forward
        overwrites a graph's routing)."""
        self.queue.flush()                    # an earlier forward's records first: they read the same buffers
        log = self.routing_log[:]
        self.routing_log.clear()
        layers = [layer for layer, _ in log]
        ids = torch.stack([ids for _, ids in log])
        host = self.staging.host(f"routing_log.ids.{tuple(ids.shape)}", ids.shape, ids.dtype)
        host.copy_(ids, non_blocking=self.cuda)
        copied = None
        if self.cuda:
            copied = torch.cuda.Event()
            copied.record()
        record = (layers, host, copied)
        if self.queue.overlap:
            self.queue.defer(self.record, record)
        else:
            self.record(record)

    def record(self, record) -> None:
        layers, host, copied = record
        if copied is not None:
            copied.synchronize()
        for layer, ids in zip(layers, host.numpy()):
            self.residency.record_resident(layer, ids.copy())
