"""ExpertStore: every routed expert in (pinned) host memory, one contiguous blob per expert: gate | up | down.

One blob per expert means loading an expert onto the GPU is a single copy. The store is filled tensor by tensor
while the checkpoint streams in, so the experts never exist twice in host memory. With expert_dtype "fp8" each
tensor is quantised as it comes in, and a blob is bytes: e4m3 weights, then their scales (oled/fp8.py).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from .. import fp8
from ..models.config import ModelConfig

log = logging.getLogger("oled")
PARTS = ("gate_proj", "up_proj", "down_proj")


class ExpertStore:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, pin: bool, expert_dtype: str = "bf16"):
        """dtype: the model's (what the experts compute in); expert_dtype: how a blob holds them, "bf16" (in dtype,
        as published) or "fp8" (oled/fp8.py)."""
        fp8.check_expert_dtype(expert_dtype)
        self.config, self.dtype, self.expert_dtype = config, dtype, expert_dtype
        self.fp8 = expert_dtype == "fp8"
        self.layers = config.moe_layers
        self.layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        H, I = config.hidden_size, config.expert_intermediate_size
        self.hidden, self.intermediate = H, I
        # a blob's elements, of blob_dtype: the pool's slots and the copies take them as they are
        self.blob_dtype = fp8.BLOB if self.fp8 else dtype
        self.numel = fp8.blob_bytes(H, I) if self.fp8 else config.expert_numel
        self.pinned = False
        self.pinned_failed = False
        self.blobs = self._alloc(pin)      # per layer [E, numel]; row e = expert e's blob
        self.loaded = np.zeros((len(self.layers), config.num_experts, len(PARTS)), dtype=np.int32)

    def _alloc(self, pin: bool) -> list[torch.Tensor]:
        """Each layer's blobs [E, numel]: pageable, or pinned in groups of layers (pinned_layer_groups)."""
        shape = (self.config.num_experts, self.numel)
        layers: list[torch.Tensor] = []
        if pin:
            try:
                for count in pinned_layer_groups(self.layer_bytes, len(self.layers)):
                    group = torch.empty((count * shape[0], shape[1]), dtype=self.blob_dtype, pin_memory=True)
                    layers.extend(group.view(count, *shape).unbind(0))
                self.pinned = True
            except RuntimeError as e:  # e.g. locked-memory limit; pageable still works, just slower copies
                log.warning("could not pin expert memory (%s); falling back to pageable host memory", e)
                self.pinned_failed = True
        return layers + [torch.empty(shape, dtype=self.blob_dtype) for _ in range(len(self.layers) - len(layers))]

    @property
    def layer_bytes(self) -> int:
        return self.config.num_experts * self.expert_bytes

    @property
    def expert_bytes(self) -> int:
        return self.numel * self.blob_dtype.itemsize

    @property
    def host_bytes(self) -> int:
        return len(self.layers) * self.config.num_experts * self.expert_bytes

    def blob(self, layer: int, expert: int) -> torch.Tensor:
        return self.blobs[self.layer_pos[layer]][expert]

    def part(self, layer: int, expert: int, part: str) -> torch.Tensor:
        """One projection of an expert in nn.Linear layout ([out, in]) as the model computes with it: a view inside
        its blob, or with fp8 its weights dequantised to the model's dtype (a new tensor)."""
        blob = self.blob(layer, expert)
        if self.fp8:
            return fp8.dequantise(*fp8.part_views(blob, PARTS.index(part), self.hidden, self.intermediate),
                                  self.dtype)
        return blob_part(blob, part, self.hidden, self.intermediate)

    def put(self, layer: int, expert: int, part: str, tensor: torch.Tensor) -> None:
        """Write one projection (from the checkpoint or random weights, on any device) into its expert's blob; with
        fp8 quantised first, where the tensor is (a GPU quantises the random weights it made)."""
        blob, index = self.blob(layer, expert), PARTS.index(part)
        if self.fp8:
            q_view, scale_view = fp8.part_views(blob, index, self.hidden, self.intermediate)
            self._check_shape(q_view, tensor)
            q, scale = fp8.quantise(tensor)
            q_view.copy_(q)
            scale_view.copy_(scale)
        else:
            view = blob_part(blob, part, self.hidden, self.intermediate)
            self._check_shape(view, tensor)
            view.copy_(tensor)
        self.loaded[self.layer_pos[layer], expert, index] += 1

    @staticmethod
    def _check_shape(view: torch.Tensor, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != tuple(view.shape):
            raise ValueError(f"expected shape {tuple(view.shape)}, got {tuple(tensor.shape)}")

    def missing(self) -> list[str]:
        return self._names(self.loaded == 0)

    def duplicated(self) -> list[str]:
        return self._names(self.loaded > 1)

    def _names(self, which: np.ndarray) -> list[str]:
        li, ei, pi = np.nonzero(which)
        return [f"model.layers.{self.layers[l]}.mlp.experts.{e}.{PARTS[p]}.weight" for l, e, p in zip(li, ei, pi)]


def pinned_layer_groups(layer_bytes: int, layers: int) -> list[int]:
    """How many layers each pinned allocation holds. torch's pinned-memory allocator rounds an allocation up to a
    power of two (one a layer, a 3 GiB layer of FP8 flash experts would pin 4 GiB), so the layers are pinned in
    groups: all that are left where a power of two holds them with less than a layer to spare, else as many as the
    largest power of two below their bytes holds."""
    groups = []
    while layers:
        left = layers * layer_bytes
        ceiling = 1 << (left - 1).bit_length()
        count = layers if ceiling - left < layer_bytes else max(1, (ceiling // 2) // layer_bytes)
        groups.append(count)
        layers -= count
    return groups


def pinned_bytes(layer_bytes: int, layers: int) -> int:
    """Host memory the pinned store takes: each group of pinned_layer_groups rounded up to a power of two."""
    return sum(1 << (count * layer_bytes - 1).bit_length() for count in pinned_layer_groups(layer_bytes, layers))


def blob_part(blob: torch.Tensor, part: str, hidden: int, intermediate: int) -> torch.Tensor:
    n = hidden * intermediate
    i = PARTS.index(part)
    view = blob[i * n:(i + 1) * n]
    return view.view(hidden, intermediate) if part == "down_proj" else view.view(intermediate, hidden)
