"""The MoE block: router (a pure function) + routed experts run by the expert backend + shared expert."""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import SwiGLU
from .router import route


class MoEBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.router_weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        # in the model dtype, as the official models hold this buffer once loaded (see router.py)
        self.expert_bias = (nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
                            if config.use_expert_bias else None)
        self.shared = (SwiGLU(config.hidden_size, config.shared_intermediate_size)
                       if config.num_shared_experts else None)
        # Set by the model runner: the expert backend (runtime/backend.py ExpertBackend: the ExpertManager or a
        # stand-in), whose run(layer_idx, x, ids, weights, shared) -> [T, H] is the routed output plus shared(x),
        # and shared_ahead(x, shared) -> the `shared` to pass.
        self.experts = None
        # Set for a trace replay (oled/trace/source.py): routing(layer_idx, ids, weights) -> the recorded routing,
        # which replaces the router's; predicted(layer_idx, x) -> the recorded prediction of this layer's routing.
        self.routing_source = None
        self.fused_router = False      # set by use_fused_router (EngineConfig.fused_router): the Triton router kernels

    def use_fused_router(self) -> None:
        """Route with the Triton kernels: the gate GEMM reads the router weight as stored (its exact products in
        fp32, as the reference's cast to fp32 gives them) and the routing kernel the logits."""
        self.fused_router = True

    def route(self, x: torch.Tensor):
        """The router itself."""
        return route(self.config, x, self.router_weight, self.expert_bias, fused=self.fused_router)

    def routing(self, x: torch.Tensor):
        """The routing the layer uses: the router's, or the replayed trace's (the router still runs: its cost)."""
        ids, weights = self.route(x)
        if self.routing_source is not None:
            ids, weights = self.routing_source.routing(self.layer_idx, ids, weights)
        return ids, weights

    def predicted_routing(self, x: torch.Tensor, ahead: int = 1):
        """This layer's routing predicted from x, the input of the MoE layer `ahead` layers before it (what
        prefetching policies see: the previous layer's)."""
        if self.routing_source is not None:
            return self.routing_source.predicted(self.layer_idx, x, ahead)
        return self.route(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the backend may start the shared expert now, beside the router (ExpertBackend.shared_ahead)
        shared = self.experts.shared_ahead(x, self.shared) if self.shared is not None else None
        ids, weights = self.routing(x)
        return self.experts.run(self.layer_idx, x, ids, weights, shared)
