"""EngineConfig: one dataclass whose fields are the engine's CLI flags."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineConfig:
    model: str | None = None              # checkpoint directory; None: the bundled tiny model
    random_weights: str | None = None     # a preset with random weights in memory instead of a checkpoint
    layers: int | None = None             # override num_hidden_layers of a random-weights preset
    seed: int = 0                         # random-weights seed
    device: str | None = None             # default: cuda if available, else cpu
    dtype: str | None = None              # default: bfloat16 on cuda, float32 on cpu
    expert_budget: str = "1.0"            # fraction (0.4), percentage (40%) or size (12GiB) of routed-expert bytes
    policy: str = "oled"                  # oled/policies: oled (default), oled-retain, oled-coop, or a baseline
    misses: str | None = None             # lru, lfu, prefetch, oled-coop: "load" or "cooperative" (planner + CPU)
    waves: bool = False                   # oled, oled-coop: misses beyond the free slots may load in further waves
    tide_tau: int | None = None           # tide: refresh period in iterations
    popularity: str | None = None         # fiddler: calibration file (expert popularity per layer)
    cpu_threads: int | None = None        # CPU expert kernel threads (default: physical cores minus torch's)
    torch_threads: int | None = None      # torch intra-op threads (default: 1, sized with cpu_threads)
    pin_memory: bool = True
    cuda_graphs: bool = True              # replay repeated forwards of static placements (full) as CUDA graphs
    offload_graphs: bool = True           # also replay offloaded forwards, in segments between host round trips
    fused_router: bool = False            # LLaDA2's router as one Triton kernel after the gate GEMM (needs Triton and
                                          # CUDA, or TRITON_INTERPRET=1; off until measured in the engine)
    profile: bool = False                 # time sections (attention, experts, copy wait, CPU) with events

    def to_dict(self) -> dict:
        return asdict(self)
