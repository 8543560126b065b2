"""The model runner: the one owner of a forward's machinery.

It holds the model with its kernel choices, the KV cache (one, kept across requests and grown when a request needs
more positions), the CUDA graphs of the forwards that repeat (decoding/graphs.py), and the expert backend the MoE
layers call (the ExpertManager, or for one pass a stand-in that wraps it: a trace recorder, a profiling probe). The
decoding loop asks it for a KV cache and for forwards and never sees which of them are replayed; the engine hands
it a new manager when the policy or budget changes; nothing else wires the MoE layers.
"""
from __future__ import annotations

import contextlib

import torch

from ..kernels import triton_confidence
from ..models.config import ModelConfig
from .graphs import ForwardGraphs
from .kv_cache import KVCache
from .rules import predict as torch_predict
from .rules import with_greedy


class ModelRunner:
    def __init__(self, model, *, cuda_graphs: bool = True, offload_graphs: bool = True, graph_backend=None,
                 max_graphs: int = 8):
        """cuda_graphs: replay the forwards that repeat (on CUDA; or anywhere with `graph_backend`, e.g. the tests'
        CPU emulation of graph semantics); offload_graphs: offloaded forwards too, as segments around the manager's
        host steps (an all-resident forward is one graph either way)."""
        self.model = model
        self.config: ModelConfig = model.config
        param = model.embed.weight
        self.device, self.dtype = param.device, param.dtype
        self.graph_backend = graph_backend
        self.cuda_graphs = cuda_graphs and (graph_backend is not None or self.device.type == "cuda")
        self.offload_graphs, self.max_graphs = offload_graphs, max_graphs
        self.predict = torch_predict          # logits -> (x0, confidence) on the device; use_kernels may swap it
        self.manager = None                   # the attached expert backend
        self.graphs: ForwardGraphs | None = None
        self.kv: KVCache | None = None
        self._stand_in = None                 # the backend of a borrowed() pass, if one is under way
        self._host_buffers: dict[tuple, torch.Tensor] = {}    # (shape, dtype) -> pinned buffer of read_back

    # --------------------------------------------------------------------------------------------- kernels
    def use_kernels(self, kernels: dict[str, bool], model_name: str = "the model") -> None:
        """The model's Triton kernels (EngineConfig.fused_*, resolved): the router, the norms with RoPE and the KV
        write, the attention, the dense MLPs and shared experts, the skinny GEMMs of a decode step, the LM head's
        confidence. The routed experts' kernels are the manager's. Graphs captured before hold the old kernels:
        dropped."""
        if kernels.get("fused_router"):
            if self.config.router != "sigmoid_group":
                raise ValueError(f"--fused-router implements LLaDA2's sigmoid group routing; {model_name} routes "
                                 f"with {self.config.router}")
            for block in self.model.moe_blocks():
                block.use_fused_router()
        self.model.use_fused_norm(bool(kernels.get("fused_norm")))
        self.model.use_fused_attention(bool(kernels.get("fused_attention")))
        if kernels.get("fused_mlp"):
            self.model.use_fused_mlp()
        self.model.use_fused_linear(bool(kernels.get("fused_linear")))
        self.predict = torch_predict
        if kernels.get("fused_confidence"):
            self.predict = with_greedy(triton_confidence.greedy_confidence)
        self._drop_graphs()

    # ------------------------------------------------------------------------------------- expert backend
    def attach(self, manager) -> None:
        """Wire `manager` into every MoE layer (and its layers' routing predictors into it) and make the graphs
        for its path: one graph per forward shape when every expert is resident, segments around the host steps
        otherwise (with offload_graphs). Graphs hold the slot pool's addresses and a placement, so a new manager
        starts with none."""
        self.detach()
        self.manager = manager
        for block in self.model.moe_blocks():
            block.experts = manager
            manager.predictors[block.layer_idx] = block.predicted_routing
            if block.shared is not None and manager.shared_in_moe:
                manager.use_shared_blob(block.layer_idx, block.shared.expert_blob())
        static = manager.all_resident
        if self.cuda_graphs and (static or self.offload_graphs):
            self.graphs = ForwardGraphs(self.model, manager.graph_hooks, backend=self.graph_backend, segmented=not static,
                                        max_graphs=self.max_graphs)

    def detach(self):
        """Unwire the attached manager (returned; the caller closes it) and drop its graphs."""
        old, self.manager = self.manager, None
        self._drop_graphs()
        self.graphs = None
        for block in self.model.moe_blocks():
            block.experts = None
        return old

    @property
    def experts(self):
        """The backend the MoE layers call now: a borrowed() stand-in, else the attached manager. The decoding loop
        tells it what each forward is."""
        return self._stand_in if self._stand_in is not None else self.manager

    @contextlib.contextmanager
    def borrowed(self, stand_in):
        """For one pass the MoE layers call `stand_in` (which wraps the attached manager) and forwards run eagerly
        (a stand-in sees every layer; a replayed graph would skip it)."""
        if self._stand_in is not None:
            raise RuntimeError("the model runner is already lent to another stand-in")
        blocks = self.model.moe_blocks()
        self._stand_in = stand_in
        for block in blocks:
            block.experts = stand_in
        try:
            yield stand_in
        finally:
            self._stand_in = None
            for block in blocks:
                block.experts = self.manager

    def set_routing_source(self, source) -> None:
        """Every MoE layer takes its routing from `source` (a TraceSource; None: from its router). Captured graphs
        read the router's outputs: dropped."""
        for block in self.model.moe_blocks():
            block.routing_source = source
        self._drop_graphs()

    # --------------------------------------------------------------------------------------------- forwards
    def kv_cache(self, length: int) -> KVCache:
        """The KV cache, with room for `length` positions: kept across requests (a graph holds its addresses) and
        replaced by a larger one, every graph dropped, when a request needs more."""
        if self.kv is None or self.kv.max_len < length:
            self._drop_graphs()
            self.kv = None                    # the old cache goes before the larger one is allocated
            self.kv = KVCache(self.config, length, self.dtype, self.device)
        return self.kv

    def forward(self, ids: torch.Tensor, start: int, kv: KVCache, kv_end: int, rows: slice | None, *,
                block_length: int, timer=None):
        """Tokens `ids` (on the host or the device) at positions [start, start + len) against keys [0, kv_end); fp32
        logits of `rows` (None: the forward only writes the cache). A shape seen before is replayed from its graph,
        unless a stand-in is in place or sections are timed (the timer needs the eager forward)."""
        if self.graphs is not None and self._stand_in is None and timer is None:
            return self.graphs(ids, start, kv, kv_end, rows, block_length=block_length)
        ids = ids.to(self.device)
        if timer is not None:
            return self.model(ids, start, kv, kv_end, rows, block_length=block_length, timer=timer)
        return self.model(ids, start, kv, kv_end, rows, block_length=block_length)

    def read_back(self, tensor: torch.Tensor) -> "HostCopy":
        """Queue `tensor`'s copy to the host now (a pinned buffer of its shape, kept), to be taken later with
        HostCopy.wait(): work queued on the stream in between (the expert backend's, for a later forward) does not
        delay it, as it would a blocking copy issued after that work. The buffer is reused by the next read_back
        of the shape: take the values before that."""
        if self.device.type != "cuda":
            return HostCopy(tensor.cpu(), None)
        key = (tuple(tensor.shape), tensor.dtype)
        buf = self._host_buffers.get(key)
        if buf is None:
            buf = self._host_buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        buf.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return HostCopy(buf, done)

    def _drop_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()


class HostCopy:
    """A device-to-host copy in flight (ModelRunner.read_back)."""

    def __init__(self, host: torch.Tensor, done):
        self.host, self.done = host, done

    def wait(self):
        """The copied values as a NumPy array (a view of the pinned buffer)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.numpy()
