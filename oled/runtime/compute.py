"""The routed experts' compute over the slot pool, shared by every execution path.

A layer's pairs (token, expert) are computed from their slots (grouped_swiglu, or with EngineConfig.fused_moe the
Triton kernels of oled/kernels/triton_moe.py, which also read misses from the pinned store and look the slots up in
the device slot map themselves), then combined in routing order in fp32, so the result does not depend on where an
expert ran. The shared expert runs where it costs least: in the fused kernels' launches (shared_in_moe), on a side
stream beside the router (shared_stream), or behind the hits.
"""
from __future__ import annotations

import torch

from .device_state import DeviceSlots
from .grouped import grouped_swiglu
from .store import ExpertStore
from .timer import Sections


class _Forked:
    """A shared expert's output computed on a side stream: called as the shared expert (on x, which it already
    read), the current stream waits for the side's work and gets the output. No record_stream is needed: that wait
    orders every later use and reuse of x, of the output and of their memory after the side's work."""

    def __init__(self, out: torch.Tensor, stream):
        self.out, self.stream = out, stream

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda.current_stream(self.out.device).wait_stream(self.stream)
        return self.out


class ExpertCompute:
    def __init__(self, store: ExpertStore, device: torch.device, sections: Sections, *, fused_moe: bool,
                 shared_stream: bool, shared_in_moe: bool):
        self.store, self.sections = store, sections
        self.device, self.cuda = device, device.type == "cuda"
        self.slots: DeviceSlots | None = None     # the slot pool and map it computes over (set once they exist)
        self.hidden, self.inter = store.hidden, store.intermediate
        self.layer_pos = store.layer_pos
        # EngineConfig.fused_moe: the Triton kernels over the slot pool instead of grouped_swiglu; they write the
        # served pairs' rows only
        self.fused_swiglu = self.fused_combine = None
        self.fused_swiglu_rows = 0
        if fused_moe:
            # Triton: an optional dependency, imported only where its kernels are asked for
            from ..kernels.triton_moe import combine_pairs, fused_swiglu_pairs, mapped_rows
            self.fused_swiglu, self.fused_combine = fused_swiglu_pairs, combine_pairs
            self.fused_swiglu_rows = mapped_rows(True)
        # EngineConfig.shared_stream: the shared expert reads only the layer's input, so on the one-graph paths it runs
        # on a second stream beside the router and the routed experts (a fork and a join a layer, which a graph
        # captures; shared_ahead)
        self.shared_stream = torch.cuda.Stream(self.device) if self.cuda and shared_stream else None
        # EngineConfig.shared_in_moe: the fused MoE kernels compute each layer's shared expert as one more expert of
        # every token, from its blob (layer -> blob, given by the model runner: use_shared_blob), in the launches of
        # the layer's hits, on every path: no GEMMs, activation or stream of its own
        # (not over FP8 slots: the shared expert stays bf16, and a launch reads one blob layout)
        self.shared_in_moe = bool(shared_in_moe) and self.fused_swiglu is not None and not store.fp8
        self.shared_blobs: dict[int, torch.Tensor] = {}

    def grouped(self, layer, x, pair_slots, y_pairs, n_valid: int | None, host: bool = False) -> None:
        """Grouped compute of the pairs with a slot (>= 0) into their rows of y_pairs. n_valid=None writes every row
        (rows of pairs without a slot get unspecified values: a static shape for graphs); otherwise only the
        n_valid rows of the served pairs, leaving the others as they are. The fused kernels write the served
        rows only, either way; with `host`, a pair slot past the layer's (its first + capacity + e) names expert e's
        blob in the pinned store."""
        with self.sections("gpu_experts"):
            base, pool = self.slots.pool(layer)
            if self.fused_swiglu is not None:
                self.fused_swiglu(x, pair_slots, pool, self.hidden, self.inter, y_pairs, slot_base=base,
                                  host=self.store.blobs[self.layer_pos[layer]] if host else None)
                return
            k = pair_slots.shape[0] // x.shape[0]                 # pairs are token-major: T tokens x k experts
            pair_tokens = torch.arange(pair_slots.shape[0], device=x.device) // k
            order, y = grouped_swiglu(x, pair_tokens, pair_slots, pool, self.hidden, self.inter, slot_base=base)
            if n_valid is None or n_valid == pair_slots.shape[0]:
                y_pairs.index_copy_(0, order, y)
            else:
                y_pairs.index_copy_(0, order[:n_valid], y[:n_valid])

    def grouped_all(self, layer, x, ids, shared=None, mapped: bool = False, routing=None, cpu_share=None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The grouped compute of every pair whose expert the device slot map holds, one output row per (token,
        expert) pair; rows of pairs without one are unspecified, or with `mapped` computed from the pinned store.
        The kernels and shapes do not depend on the routing, so a graph replays them. The fused kernels look the
        slots up in the map themselves; with routing = (weights, buffer) their alignment also writes the routing
        into the buffer (readback.routing_of's layout). Returns the pair outputs and the shared expert's output:
        from the same launches when the layer's blob is in shared_blobs, else shared(x) after them (None: no shared
        expert)."""
        flat = ids.reshape(-1)
        pos = self.layer_pos[layer]
        row = self.slots.slot_map[pos]
        blob = self.shared_blobs.get(layer) if shared is not None else None
        rows = flat.shape[0] + (x.shape[0] if blob is not None else 0)      # the shared expert's rows last
        y = torch.empty(rows, self.hidden, dtype=x.dtype, device=x.device)
        y_pairs = y[: flat.shape[0]]
        if self.fused_swiglu is not None:
            with self.sections("gpu_experts"):
                base, pool = self.slots.pool(layer)
                capture = self.slots.capture_table
                self.fused_swiglu(x, flat, pool, self.hidden, self.inter, y, slot_base=base, slot_map=row,
                                  host=self.store.blobs[pos] if mapped else None,
                                  capture=capture[pos] if mapped and capture is not None else None,
                                  routing=routing, shared=blob, cpu_share=cpu_share)
        else:
            self.grouped(layer, x, row.index_select(0, flat), y_pairs, n_valid=None)
        if blob is not None:
            return y_pairs, y[flat.shape[0]:]
        return y_pairs, shared(x) if shared is not None else None

    def combine(self, y_pairs, weights, shared_out=None, cpu_share=None):
        """sum_k weights[t, k] * y_pairs[t * k + k'], in fp32, in routing order, in the model dtype; + shared_out
        (the shared expert's output) when given, as the model adds it. cpu_share: the pairs of a mapped layer's CPU
        share are taken from the CPU's rows (fused kernels only)."""
        if self.fused_combine is not None:
            return self.fused_combine(y_pairs, weights, shared_out, cpu_share=cpu_share)
        T, k = weights.shape
        out = (y_pairs.view(T, k, -1).float() * weights.unsqueeze(-1)).sum(dim=1).to(y_pairs.dtype)
        return out if shared_out is None else out + shared_out

    def use_shared_blob(self, layer: int, blob: torch.Tensor) -> None:
        """With shared_in_moe, `layer`'s shared expert is computed by the fused MoE kernels from `blob` (its weights
        in a routed expert's layout, SwiGLU.expert_blob) instead of by the callable run() gets."""
        if self.shared_in_moe:
            self.shared_blobs[layer] = blob

    def shared_ahead(self, x, shared, one_graph: bool):
        """What the MoE layer passes to run() as its shared expert, called before the layer routes: on the one-graph
        forwards (all-resident, mapped: `one_graph`) with a shared stream, the shared expert queued there now,
        beside the router, the alignment and the routed experts (small latency-bound kernels side by side); else
        `shared` itself, run where run() runs it (the offloaded path queues it behind its hits, and a segmented
        graph must not leave a fork open across a host step)."""
        if self.shared_stream is None or self.shared_in_moe or not one_graph:
            return shared
        self.shared_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.shared_stream):
            return _Forked(shared(x), self.shared_stream)
