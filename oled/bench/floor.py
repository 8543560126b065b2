"""A forward's bandwidth floor: the weight bytes it must read over the device memory's measured bandwidth."""
from __future__ import annotations

import torch


def measure_hbm_bandwidth(device) -> float:
    """Device-to-device copy GB/s counting bytes read plus written (the practical HBM ceiling); NaN off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(2**30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    e.synchronize()
    return 2 * a.numel() * 10 / (s.elapsed_time(e) / 1e3) / 1e9


def weight_bytes_per_iteration(engine, unique_experts_per_layer: float, block: int) -> float:
    """Weights one iteration must read: every non-expert weight except the embedding table (only `block` rows of
    it), plus the unique routed experts of each MoE layer."""
    m = engine.model
    itemsize = m.embed.weight.element_size()
    non_expert = sum(p.numel() * p.element_size() for p in m.parameters()) - m.embed.weight.numel() * itemsize
    non_expert += block * m.config.hidden_size * itemsize
    experts = unique_experts_per_layer * len(m.config.moe_layers) * engine.store.expert_bytes
    return non_expert + experts
