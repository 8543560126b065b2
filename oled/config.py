"""EngineConfig: one dataclass whose fields are the engine's CLI flags."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

CPU_WAKE_MODES = ("auto", "layer", "forward", "off")       # EngineConfig.cpu_wake
CPU_ISAS = ("auto", "avx512_bf16", "portable")     # EngineConfig.cpu_isa


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
    # the CPU expert kernel (runtime/cpu_kernel.py; its design notes: benchmarks/probes/CPU_KERNEL_NOTES.md)
    cpu_wake: str = "auto"                # when its sleeping workers are woken: layer (ahead of a layer that had CPU
                                          # work the last time), forward (held through each forward) or off; auto:
                                          # layer with a CUDA device, off with a CPU one (runtime/manager.py)
    cpu_cost_feedback: bool = False       # the planner's CPU terms follow the CPU jobs' time in the engine (median
                                          # ratio to the start-up cost model, per forward); off by default
                                          # (docs/decisions.md: cpu-cost-feedback-off)
    cpu_isa: str = "auto"                 # auto (AMX for jobs of cpu_amx_min_tokens or more, else AVX-512 BF16, where
                                          # the CPU has them), avx512_bf16, or portable C
    cpu_amx_min_tokens: int = 4           # 0: never AMX
    cpu_pin: bool = True                  # pin the workers to the last physical cores
    cpu_spin_us: float = 50.0             # a worker polls this long before it sleeps
    cpu_chunks: int = 4                   # work chunks per worker and call
    cpu_prefetch: bool = True             # software prefetch of the next weight tiles
    cpu_prefetch_distance: int = 4        # tiles ahead
    pin_memory: bool = True
    cuda_graphs: bool = True              # replay repeated all-resident forwards as CUDA graphs
    offload_graphs: bool = True           # also replay offloaded forwards, in segments between host round trips
    # A denoising iteration's misses read by the fused MoE kernels from the pinned store (over PCIe) inside the
    # forward: no host round trip, one graph; the policy's loads fill slots for the next forwards. No miss is
    # computed on the CPU: prefills and cache fills keep the host round trip, where the misses a policy sends to the
    # CPU are read from host memory (runtime/manager.py). None: on where the fused MoE kernels run and the store is
    # pinned.
    mapped_misses: bool | None = None
    # With mapped misses: slots of a layer (its free ones, then those of the experts it would evict next) that a
    # mapped forward writes the misses it reads from host memory into, skipping any slot the forward reads, so a
    # kept miss crosses PCIe once, not read and then copied (runtime/residency.py; at most half the layer's slots).
    # 0: every kept miss is copied after the forward (docs/decisions.md: capture-slots).
    capture_slots: int = 16
    # With mapped misses and a policy that computes misses on the CPU (oled, oled-coop, lru:misses=cooperative,
    # fiddler, tide): each layer of a mapped forward gives the CPU kernel some of the misses its slots could not keep,
    # computed beside the GPU's reads; the layer's combine waits for the CPU's rows (runtime/cpu_share.py: how many
    # from the cost model, which by expert id). Off by default (docs/decisions.md: cpu-share-off)
    cpu_share: bool = False
    # The Triton kernels (oled/kernels), each in place of its torch path. True needs Triton and CUDA (or
    # TRITON_INTERPRET=1); False is torch's path; None (the default) is on where they run compiled (a CUDA device
    # with Triton; the router only for LLaDA2's routing), torch's path elsewhere (docs/decisions.md: triton-kernels).
    fused_router: bool | None = None      # LLaDA2's gate GEMM and routing (sigmoid, bias, group limit, top-k)
    fused_moe: bool | None = None         # the routed experts over the slot pool and their weighted combine
    fused_norm: bool | None = None        # each RMSNorm with its residual add; the attention prologue (QK-norm,
                                          # RoPE, the KV-cache write)
    fused_mlp: bool | None = None         # the dense MLPs and shared experts: gate|up as one GEMM, SiLU * up fused
    fused_confidence: bool | None = None  # greedy x0 and its probability from the LM head's logits in one pass
    fused_attention: bool | None = None   # each layer's attention over the KV cache (SDPA and its mask) in one
                                          # launch, written as o_proj reads it
    fused_linear: bool | None = None      # the attention's QKV and output GEMMs and the dense MLPs' and shared
                                          # experts' of up to 64 rows (a decode step) as a skinny Triton GEMM;
                                          # None is off (Engine.OPT_IN; docs/decisions.md: fused-linear-off)
    # where the shared expert has GEMMs of its own (shared_in_moe off, or torch's MoE path): on a second CUDA stream
    # beside the routed experts, in the all-resident and mapped forwards (both graphs capture the fork); the same
    # kernels on the same inputs, so the same bits
    shared_stream: bool = True
    # the shared expert computed by the fused MoE kernels (fused_moe) as one more expert of every token, in the
    # launches of the layer's routed experts, on every path: no GEMMs, activation or stream of its own
    # (docs/decisions.md: shared-expert-in-moe)
    shared_in_moe: bool = True
    profile: bool = False                 # time sections (attention, experts, copy wait, CPU) with events

    def to_dict(self) -> dict:
        return asdict(self)


# EngineConfig's Triton-kernel switches, in field order (the CLI's --fused-* flags, `--fused` for all)
FUSED_KERNELS = tuple(f.name for f in fields(EngineConfig) if f.name.startswith("fused_"))
# the kernels that stay off unless asked for: the skinny GEMM was slower than cuBLAS (docs/decisions.md:
# fused-linear-off)
FUSED_OPT_IN = frozenset({"fused_linear"})
