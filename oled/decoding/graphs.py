"""CUDA graphs for the forwards that repeat, so that the host stops bounding the decode.

Every iteration of a block after its first runs the same number of tokens at the same positions against the same
keys. With a static expert placement (`full`) such a forward needs no host decision at all, so it can be captured
once and replayed: one launch instead of ~90 kernel launches per layer issued from Python. On the H200 an eager
4-layer LLaDA2.0-mini forward takes 10.5 ms of host time for 1.7 ms of GPU work (benchmarks/profile_forward.py).

A shape is captured on its second use (a block's first forward runs once, so capturing it would not pay) and
replayed from then on. A replay runs the very kernels the eager forward ran, on the same shapes, so its tokens are
those of the eager path. The KV cache is owned here and kept across requests: a graph holds its addresses.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from .kv_cache import KVCache

log = logging.getLogger("oled")


class CudaGraphBackend:
    """Capture and replay with torch.cuda.CUDAGraph (the only backend outside the tests)."""

    @staticmethod
    def capture(fn):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out

    @staticmethod
    def release(graph) -> None:
        graph.reset()


class ForwardGraphs:
    """Runs model forwards, replaying a captured graph for a (tokens, start, keys, rows) shape seen before.

    The manager's static path logs each layer's routing on the device and reads it back once per forward; a graph
    keeps the tensors its capture logged and hands them to the manager after every replay, so statistics are kept
    exactly as in an eager forward.
    """

    def __init__(self, model, manager, backend=CudaGraphBackend, max_graphs: int = 4, max_seen: int = 4096):
        self.model, self.manager, self.backend = model, manager, backend
        self.max_graphs, self.max_seen = max_graphs, max_seen
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.seen: set[tuple] = set()
        self.kv: KVCache | None = None
        self.enabled = True
        self.captures = self.replays = 0

    def kv_cache(self, length: int) -> KVCache:
        """The persistent KV cache, grown (and every graph dropped) when a request needs more positions."""
        if self.kv is None or self.kv.max_len < length:
            self.clear()
            p = self.model.embed.weight
            self.kv = KVCache(self.model.config, length, p.dtype, p.device)
        return self.kv

    def clear(self) -> None:
        for g in self.graphs.values():
            self.backend.release(g.graph)
        self.graphs.clear()
        self.seen.clear()

    def __call__(self, ids: torch.Tensor, start: int, kv: KVCache, kv_end: int, rows: slice | None):
        if not self.enabled or kv is not self.kv:
            return self.model(ids, start, kv, kv_end, rows)
        key = (ids.shape[0], start, kv_end, None if rows is None else (rows.start, rows.stop, rows.step))
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.seen:
                if len(self.seen) >= self.max_seen:
                    self.seen.clear()
                self.seen.add(key)
                return self.model(ids, start, kv, kv_end, rows)
            graph = self._capture(key, ids, start, kv, kv_end, rows)
            if graph is None:
                return self.model(ids, start, kv, kv_end, rows)
        else:
            self.graphs.move_to_end(key)
        graph.ids.copy_(ids)
        graph.graph.replay()
        self.replays += 1
        self.manager.log_routing(graph.routing)
        return graph.out

    def _capture(self, key, ids, start, kv, kv_end, rows) -> _Graph | None:
        static_ids = ids.clone()
        mark = self.manager.routing_mark()
        try:
            graph, out = self.backend.capture(lambda: self.model(static_ids, start, kv, kv_end, rows))
        except RuntimeError as e:                 # e.g. an operation that syncs with the host: stay eager
            self.manager.take_routing(mark)
            self.enabled = False
            log.warning("CUDA graph capture failed, forwards run eagerly from now on: %s", str(e).splitlines()[0])
            return None
        routing = self.manager.take_routing(mark)  # logged by the capture, which ran no kernel
        if len(self.graphs) >= self.max_graphs:
            _, old = self.graphs.popitem(last=False)
            self.backend.release(old.graph)
        g = self.graphs[key] = _Graph(graph, static_ids, out, routing)
        self.captures += 1
        return g


class _Graph:
    __slots__ = ("graph", "ids", "out", "routing")

    def __init__(self, graph, ids, out, routing):
        self.graph, self.ids, self.out, self.routing = graph, ids, out, routing
