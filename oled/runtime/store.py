"""ExpertStore: every routed expert in (pinned) host memory, one contiguous blob per expert: gate | up | down.

One blob per expert means loading an expert onto the GPU is a single copy. The store is filled tensor by tensor
while the checkpoint streams in, so the experts never exist twice in host memory.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..models.config import ModelConfig

log = logging.getLogger("oled")
PARTS = ("gate_proj", "up_proj", "down_proj")


class ExpertStore:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, pin: bool):
        self.config, self.dtype = config, dtype
        self.layers = config.moe_layers
        self.layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        H, I = config.hidden_size, config.expert_intermediate_size
        self.hidden, self.intermediate = H, I
        self.numel = config.expert_numel
        self.pinned = False
        self.pinned_failed = False
        self.blobs = [self._alloc(pin) for _ in self.layers]  # per layer [E, numel]; row e = expert e's blob
        self.loaded = np.zeros((len(self.layers), config.num_experts, len(PARTS)), dtype=np.int32)

    def _alloc(self, pin: bool) -> torch.Tensor:
        shape = (self.config.num_experts, self.numel)
        if pin and not self.pinned_failed:
            try:
                t = torch.empty(shape, dtype=self.dtype, pin_memory=True)
                self.pinned = True
                return t
            except RuntimeError as e:  # e.g. locked-memory limit; pageable still works, just slower copies
                log.warning("could not pin expert memory (%s); falling back to pageable host memory", e)
                self.pinned_failed = True
                self.pinned = False
        return torch.empty(shape, dtype=self.dtype)



    @property
    def expert_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def host_bytes(self) -> int:
        return len(self.layers) * self.config.num_experts * self.expert_bytes

    def blob(self, layer: int, expert: int) -> torch.Tensor:
        return self.blobs[self.layer_pos[layer]][expert]

    def part(self, layer: int, expert: int, part: str) -> torch.Tensor:
        """A view of one projection inside an expert's blob, in nn.Linear layout ([out, in])."""
        return blob_part(self.blob(layer, expert), part, self.hidden, self.intermediate)

    def put(self, layer: int, expert: int, part: str, tensor: torch.Tensor) -> None:
        view = self.part(layer, expert, part)
        if tuple(tensor.shape) != tuple(view.shape):
            raise ValueError(f"expected shape {tuple(view.shape)}, got {tuple(tensor.shape)}")
        view.copy_(tensor)
        self.loaded[self.layer_pos[layer], expert, PARTS.index(part)] += 1

    def missing(self) -> list[str]:
        return self._names(self.loaded == 0)

    def duplicated(self) -> list[str]:
        return self._names(self.loaded > 1)

    def _names(self, which: np.ndarray) -> list[str]:
        li, ei, pi = np.nonzero(which)
        return [f"model.layers.{self.layers[l]}.mlp.experts.{e}.{PARTS[p]}.weight" for l, e, p in zip(li, ei, pi)]


def blob_part(blob: torch.Tensor, part: str, hidden: int, intermediate: int) -> torch.Tensor:
    n = hidden * intermediate
    i = PARTS.index(part)
    view = blob[i * n:(i + 1) * n]
    return view.view(hidden, intermediate) if part == "down_proj" else view.view(intermediate, hidden)
