"""EngineConfig: the engine's settings, each declared once with its default, its help and its choices.

The settings are grouped: the model and the policy at the top, then the CPU side (CpuConfig), offloading and graphs
(OffloadConfig) and the kernels (KernelConfig). The CLI's engine flags are generated from these fields
(oled/cli/common.py), and the expert manager takes the groups. A setting is also reachable by its flat name
(`EngineConfig(capture_slots=0)`, `cfg.capture_slots`), the way the Python API and scripts write it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

CPU_WAKE_MODES = ("auto", "layer", "forward", "off")       # CpuConfig.cpu_wake
CPU_ISAS = ("auto", "avx512_bf16", "portable")            # CpuConfig.cpu_isa


def setting(default, help: str, *, choices=None, metavar=None, minimum=None, flag=None, both=False, cli=True):
    """A settings field. help: its CLI help (an argparse format string: %(default)s, %%); flag: the CLI option when
    it is not --name (or --no-name for a setting that is on by default); both: an on/off setting written
    --name/--no-name; minimum: the smallest value the CLI accepts; cli=False: no flag."""
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar,
                                            "minimum": minimum, "flag": flag, "both": both, "cli": cli})


@dataclass
class CpuConfig:
    """threads and the CPU expert kernel (runtime/cpu_kernel.py)"""
    cpu_threads: int | None = setting(None, "CPU expert threads (default: physical cores minus torch's threads)",
                                      minimum=1)
    torch_threads: int | None = setting(
        None, "torch intra-op threads (default: 1; the other physical cores go to the CPU expert kernel)", minimum=1)
    cpu_wake: str = setting(
        "auto", "when the CPU kernel's sleeping workers are woken: ahead of a layer that had CPU work the last time "
                "it ran with as many rows (layer), held through each forward, or never (off); auto: layer on a CUDA "
                "device, off on the CPU (default: %(default)s)", choices=CPU_WAKE_MODES)
    cpu_cost_feedback: bool = setting(
        False, "the planner's CPU terms follow the median ratio of the CPU jobs' time in the engine to the start-up "
               "cost model's, per forward (default: off, the model as measured; decisions then depend on timing; "
               "docs/decisions.md: cpu-cost-feedback-off)")
    cpu_isa: str = setting(
        "auto", "CPU kernel instruction set: the fastest the CPU has (AMX for jobs of --cpu-amx-min-tokens or more, "
                "else AVX-512 BF16), AVX-512 BF16 without AMX, or portable C (default: %(default)s)", choices=CPU_ISAS)
    cpu_amx_min_tokens: int = setting(
        4, "CPU jobs with at least N tokens use AMX where the CPU has it; 0: never (default: %(default)s)", metavar="N")
    cpu_pin: bool = setting(True, "do not pin the CPU kernel's workers to the last physical cores")
    cpu_spin_us: float = setting(50.0, "how long an idle CPU worker polls before it sleeps (default: %(default)s)",
                                 metavar="US")
    cpu_chunks: int = setting(4, "work chunks per CPU worker and call (default: %(default)s)", metavar="N")
    cpu_prefetch: bool = setting(True, "no software prefetch of the next weight rows in the CPU kernel")
    cpu_prefetch_distance: int = setting(
        4, "CPU kernel AMX path: prefetch distance in 64-byte columns; 0: off (default: %(default)s)", metavar="N")


@dataclass
class OffloadConfig:
    """host memory, graphs and the mapped path of a denoising iteration's misses"""
    pin_memory: bool = setting(True, "do not pin host expert memory", flag="--no-pin")
    cuda_graphs: bool = setting(
        True, "run every forward eagerly (default: replay repeated all-resident forwards as CUDA graphs)")
    offload_graphs: bool = setting(
        True, "run offloaded forwards eagerly (default: replay them as CUDA graphs, in segments between the host "
              "round trips)")
    # None: on where the fused MoE kernels run compiled and the store is pinned (Engine resolves it)
    mapped_misses: bool | None = setting(
        None, "a denoising iteration's misses are computed by the fused MoE kernels straight from the pinned expert "
              "store over PCIe, with no host round trip; the policy's loads fill slots for the next iterations, and "
              "no miss is computed on the CPU (needs the fused MoE kernels; default: on where they run compiled, on "
              "CUDA with a pinned store)")
    capture_slots: int = setting(
        16, "with mapped misses: slots a layer offers each iteration (free ones, then its next victims') into which "
            "the kernels write the misses they read from host memory, so a kept miss crosses PCIe once (at most half "
            "the layer's slots; 0: kept misses are copied after the iteration, docs/decisions.md: capture-slots; "
            "default %(default)s)", metavar="N")
    cpu_share: bool = setting(
        False, "with mapped misses and a policy that computes misses on the CPU: each layer of a denoising iteration "
               "gives the CPU kernel some of the misses its slots could not keep, computed beside the GPU's reads "
               "(how many from the measured cost model); the CPU rounds bf16 its own way, so tokens can differ from "
               "full's (docs/decisions.md: cpu-share-off; default off)", both=True)


_NEEDS = "needs Triton and CUDA; default: "
_AUTO = _NEEDS + "on with a CUDA device and Triton, torch's path elsewhere)"


@dataclass
class KernelConfig:
    """the Triton kernels (oled/kernels), each in place of its torch path, and the shared expert's stream; a kernel
    left at None is on where it runs compiled (docs/decisions.md: triton-kernels)"""
    fused_router: bool | None = setting(
        None, "LLaDA2's gate GEMM (fp32 sums of exact products) and routing (sigmoid, bias, group limit, top-k, "
              "weights) as two Triton kernels: torch's ids and weights up to the sums' order, in fewer launches (" + _AUTO)
    fused_moe: bool | None = setting(
        None, "the routed experts as Triton kernels over the GPU slot pool (pairs aligned to experts on the device, "
              "gate|up then down, written straight to each pair's row) and their weighted combine, instead of "
              "torch's grouped GEMMs (" + _AUTO)
    fused_norm: bool | None = setting(
        None, "each RMSNorm with the residual add before it, and the attention prologue (QK-norm, partial RoPE, the "
              "KV-cache write), as one Triton kernel each (" + _AUTO)
    fused_mlp: bool | None = setting(
        None, "the dense MLPs and the shared experts with gate and up as one GEMM and SiLU * up as one Triton kernel ("
              + _AUTO)
    fused_confidence: bool | None = setting(
        None, "greedy decoding's token and confidence from the LM head's logits in one Triton pass, without a softmax "
              "over the vocabulary (" + _AUTO)
    fused_attention: bool | None = setting(
        None, "each layer's attention over the KV cache as one Triton kernel (which key a query sees computed in it, "
              "no mask tensor; the keys past the chunk's end skipped), instead of the mask and torch's "
              "scaled_dot_product_attention (" + _AUTO)
    # opt-in (FUSED_OPT_IN): the skinny GEMM was slower than cuBLAS (docs/decisions.md: fused-linear-off)
    fused_linear: bool | None = setting(
        None, "the attention's QKV and output projections and the dense MLPs' and shared experts' GEMMs of a decode "
              "step (up to 64 rows; F.linear above) as a skinny Triton GEMM that reads each weight once (fp32 sums of "
              "exact products, in another order than cuBLAS's) (" + _NEEDS + "off, asked for only)")
    shared_stream: bool = setting(
        True, "compute the shared expert on the main stream, after the routed experts (default: on a second CUDA "
              "stream beside them, in the all-resident and mapped forwards)")
    shared_in_moe: bool = setting(
        True, "compute the shared expert with GEMMs of its own (default: as one more expert of every token in the "
              "fused MoE kernels' launches, where those run; docs/decisions.md: shared-expert-in-moe)")


SECTIONS = {"cpu": CpuConfig, "offload": OffloadConfig, "kernels": KernelConfig}


@dataclass(init=False)
class EngineConfig:
    """The engine's settings: EngineConfig(random_weights="tiny", policy="oled:decay=0.5", capture_slots=0) with
    flat names, or with the groups (cpu=CpuConfig(...), offload=..., kernels=...)."""
    model: str | None = setting(None, "Hugging Face checkpoint directory (default: the bundled tiny model)")
    random_weights: str | None = setting(
        None, "random weights in memory with a preset's shapes (tiny, llada2-mini, llada2-flash, ...; default: none, "
              "the checkpoint of --model)", metavar="PRESET")
    layers: int | None = setting(
        None, "override the number of layers of a random-weights preset (default: the preset's)", minimum=1)
    seed: int = setting(0, "random-weights seed")
    device: str | None = setting(None, "cuda or cpu (default: cuda if available)")
    dtype: str | None = setting(None, "bfloat16 or float32 (default: bfloat16 on cuda, float32 on cpu)")
    # not a CLI `choices`: a bad value gets the engine's one line (argparse's would add the usage)
    expert_dtype: str = setting(
        "bf16", "how the routed experts are stored and moved: bf16 (as published), or fp8 (e4m3 with a power-of-two "
                "scale per output channel, quantised at load: half the bytes in host memory, over PCIe and in GPU "
                "slots; changes the experts' numerics; dense layers, attention, router, shared expert and LM head "
                "stay bf16) (default: %(default)s)", metavar="{bf16,fp8}")
    expert_budget: str = setting(
        "1.0", "GPU memory for routed experts: fraction (0.4), percent (40%%) or size (12GiB)")
    # a policy's name with its options, name:key=value[:key=value] (oled/policies/spec.py); the CLI lists the names
    policy: str = setting("oled", "expert residency policy (default: %(default)s)", metavar="NAME[:KEY=VALUE]")
    misses: str | None = setting(
        None, "lru, lfu, prefetch, oled-coop: load every miss (the baselines' default), or let the planner split "
              "misses between loading and the CPU on the measured costs", choices=("load", "cooperative"))
    waves: bool = setting(
        False, "oled, oled-coop: a layer's misses beyond the slots not holding a hit may load in further waves "
               "instead of all going to the CPU (docs/decisions.md: one-wave; default: off)")
    tide_tau: int | None = setting(None, "tide: refresh period in iterations (default: tide's own)")
    popularity: str | None = setting(
        None, "fiddler: expert popularity file from `oled calibrate` (default: none; fiddler needs one)")
    cpu: CpuConfig = field(default_factory=CpuConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    profile: bool = setting(False, "time sections (attention, experts, copy wait, CPU) with events", cli=False)

    def __init__(self, **settings):
        unknown = set(settings) - set(SETTING_NAMES) - set(SECTIONS)
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
        for f in fields(self):
            if f.name in SECTIONS:
                given = settings.get(f.name)
                section = replace(given) if given is not None else SECTIONS[f.name]()     # never shared
                for g in fields(section):
                    if g.name in settings:
                        setattr(section, g.name, settings[g.name])
                object.__setattr__(self, f.name, section)
            else:
                setattr(self, f.name, settings.get(f.name, f.default))

    def to_dict(self) -> dict:
        """Every setting by its flat name, in declaration order (a result line's `engine`)."""
        return {f.name: getattr(self, f.name) for f in setting_fields()}


def setting_fields():
    """Every setting's field in declaration order, a group's in the group's place."""
    for f in fields(EngineConfig):
        yield from fields(SECTIONS[f.name]) if f.name in SECTIONS else (f,)


SECTION_OF = {g.name: name for name, cls in SECTIONS.items() for g in fields(cls)}    # flat name -> its group
SETTING_NAMES = tuple(f.name for f in setting_fields())


class _Flat:
    """EngineConfig.<name> for a setting of a group: the group's field on an instance, its default on the class."""

    def __init__(self, section: str, name: str, default):
        self.section, self.name, self.default = section, name, default

    def __get__(self, obj, owner=None):
        return self.default if obj is None else getattr(getattr(obj, self.section), self.name)

    def __set__(self, obj, value) -> None:
        setattr(getattr(obj, self.section), self.name, value)


for _section, _cls in SECTIONS.items():
    for _f in fields(_cls):
        setattr(EngineConfig, _f.name, _Flat(_section, _f.name, _f.default))

# the Triton-kernel switches, in field order (the CLI's --fused-* flags, `--fused` for all)
FUSED_KERNELS = tuple(f.name for f in fields(KernelConfig) if f.name.startswith("fused_"))
# the kernels that stay off unless asked for: the skinny GEMM was slower than cuBLAS (docs/decisions.md:
# fused-linear-off)
FUSED_OPT_IN = frozenset({"fused_linear"})
