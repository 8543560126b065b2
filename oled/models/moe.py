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
        # Set by the engine: an object with run(layer_idx, x, ids, weights) -> [T, H] (the ExpertManager).
        self.experts = None

    def route(self, x: torch.Tensor):
        return route(self.config, x, self.router_weight, self.expert_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.experts.run(self.layer_idx, x, ids, weights)
        if self.shared is not None:
            out = out + self.shared(x)
        return out
