"""Flags shared by the commands that load a model: the fields of EngineConfig and DecodeParams."""
from __future__ import annotations

import argparse
import inspect

from ..config import CPU_ISAS, CPU_WAKE_MODES, FUSED_KERNELS, FUSED_OPT_IN, EngineConfig
from ..decoding.params import DecodeParams
from ..policies import DEFAULT_POLICY, POLICIES, policy_class

LIVE_POLICIES = [name for name in POLICIES if not policy_class(name).needs_future]   # belady: replay only
TIDE_TAU = inspect.signature(policy_class("tide")).parameters["tau"].default         # tide's own default


def positive_int(text: str) -> int:
    """argparse type for counts that must be at least 1 (layers, threads): 0 would divide by zero or do nothing."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and runtime")
    g.add_argument("--model", help="Hugging Face checkpoint directory (default: the bundled tiny model)")
    g.add_argument("--random-weights", metavar="PRESET",
                   help="random weights in memory with a preset's shapes (tiny, llada2-mini, llada2-flash, ...; "
                        "default: none, the checkpoint of --model)")
    g.add_argument("--seed", type=int, default=0, help="random-weights seed")
    g.add_argument("--expert-budget", default="1.0",
                   help="GPU memory for routed experts: fraction (0.4), percent (40%%) or size (12GiB)")
    g.add_argument("--policy", default=DEFAULT_POLICY, choices=LIVE_POLICIES,
                   help="expert residency policy (default: %(default)s)")
    g.add_argument("--waves", action="store_true",
                   help="oled, oled-coop: a layer's misses beyond the slots not holding a hit may load in further "
                        "waves instead of all going to the CPU (docs/decisions.md: one-wave; default: off)")
    g.add_argument("--misses", choices=["load", "cooperative"],
                   help="lru, lfu, prefetch, oled-coop: load every miss (the baselines' default), or let the "
                        "planner split misses between loading and the CPU on the measured costs")
    g.add_argument("--tide-tau", type=int, help=f"tide: refresh period in iterations (default: {TIDE_TAU})")
    g.add_argument("--popularity", help="fiddler: expert popularity file from `oled calibrate` (default: none; "
                                        "fiddler needs one)")
    add_execution_args(g)
    g.add_argument("--torch-threads", type=positive_int,
                   help="torch intra-op threads (default: 1; the other physical cores go to the CPU expert kernel)")


FUSED_HELP = {
    "fused_router": "LLaDA2's gate GEMM (fp32 sums of exact products) and routing (sigmoid, bias, group limit, "
                    "top-k, weights) as two Triton kernels: torch's ids and weights up to the sums' order, in fewer "
                    "launches",
    "fused_moe": "the routed experts as Triton kernels over the GPU slot pool (pairs aligned to experts on the "
                 "device, gate|up then down, written straight to each pair's row) and their weighted combine, "
                 "instead of torch's grouped GEMMs",
    "fused_norm": "each RMSNorm with the residual add before it, and the attention prologue (QK-norm, partial RoPE, "
                  "the KV-cache write), as one Triton kernel each",
    "fused_mlp": "the dense MLPs and the shared experts with gate and up as one GEMM and SiLU * up as one Triton "
                 "kernel",
    "fused_confidence": "greedy decoding's token and confidence from the LM head's logits in one Triton pass, "
                        "without a softmax over the vocabulary",
    "fused_attention": "each layer's attention over the KV cache as one Triton kernel (which key a query sees "
                       "computed in it, no mask tensor; the keys past the chunk's end skipped), instead of the mask and "
                       "torch's scaled_dot_product_attention",
    "fused_linear": "the attention's QKV and output projections and the dense MLPs' and shared experts' GEMMs of a "
                    "decode step (up to 64 rows; F.linear above) as a skinny Triton GEMM that reads each weight once "
                    "(fp32 sums of exact products, in another order than cuBLAS's)",
}


def add_execution_args(g) -> None:
    """How the engine runs, whatever the policy (shared by every command that builds an engine, `oled bench` too)."""
    g.add_argument("--layers", type=positive_int,
                   help="override the number of layers of a random-weights preset (default: the preset's)")
    g.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    g.add_argument("--dtype", help="bfloat16 or float32 (default: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--cpu-threads", type=positive_int, help="CPU expert threads (default: physical cores minus torch's threads)")
    d = EngineConfig()
    g.add_argument("--cpu-wake", choices=CPU_WAKE_MODES, default=d.cpu_wake,
                   help="when the CPU kernel's sleeping workers are woken: ahead of a layer that had CPU work the "
                        "last time it ran with as many rows (layer), held through each forward, or never (off); auto: "
                        "layer on a CUDA device, off on the CPU (default: %(default)s)")
    g.add_argument("--cpu-isa", choices=CPU_ISAS, default=d.cpu_isa,
                   help="CPU kernel instruction set: the fastest the CPU has, AVX-512 BF16 without AMX, or portable "
                        "C (default: %(default)s)")
    g.add_argument("--cpu-amx-min-tokens", type=int, default=d.cpu_amx_min_tokens, metavar="N",
                   help="CPU jobs with at least N tokens use AMX where the CPU has it; 0: never (default: %(default)s)")
    g.add_argument("--no-cpu-pin", dest="cpu_pin", action="store_false",
                   help="do not pin the CPU kernel's workers to the last physical cores")
    g.add_argument("--cpu-spin-us", type=float, default=d.cpu_spin_us, metavar="US",
                   help="how long an idle CPU worker polls before it sleeps (default: %(default)s)")
    g.add_argument("--cpu-chunks", type=int, default=d.cpu_chunks, metavar="N",
                   help="work chunks per CPU worker and call (default: %(default)s)")
    g.add_argument("--no-cpu-prefetch", dest="cpu_prefetch", action="store_false",
                   help="no software prefetch of the next weight rows in the CPU kernel")
    g.add_argument("--cpu-prefetch-distance", type=int, default=d.cpu_prefetch_distance, metavar="N",
                   help="CPU kernel AMX path: prefetch distance in 64-byte columns; 0: off (default: %(default)s)")
    g.add_argument("--cpu-cost-feedback", action="store_true",
                   help="the planner's CPU terms follow the median ratio of the CPU jobs' time in the engine to the "
                        "start-up cost model's, per forward (default: off, the model as measured; decisions then "
                        "depend on timing)")
    g.add_argument("--no-pin", dest="pin_memory", action="store_false", help="do not pin host expert memory")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run every forward eagerly (default: replay repeated all-resident forwards as CUDA graphs)")
    add_fused_args(g)
    g.add_argument("--no-offload-graphs", dest="offload_graphs", action="store_false",
                   help="run offloaded forwards eagerly (default: replay them as CUDA graphs, in segments between the "
                        "host round trips)")
    g.add_argument("--mapped-misses", action=argparse.BooleanOptionalAction, default=d.mapped_misses,
                   help="a denoising iteration's misses are computed by the fused MoE kernels straight from the "
                        "pinned expert store over PCIe, with no host round trip; the policy's loads fill slots for "
                        "the next iterations, and no miss is computed on the CPU (needs the fused MoE kernels; "
                        "default: on where they run compiled, on CUDA with a pinned store)")
    g.add_argument("--capture-slots", type=int, default=d.capture_slots, metavar="N",
                   help="with mapped misses: slots a layer offers each iteration (free ones, then its next victims') "
                        "into which the kernels write the misses they read from host memory, so a kept miss crosses "
                        "PCIe once (at most half the layer's slots; 0: kept misses are copied after the iteration; "
                        f"default {d.capture_slots})")
    g.add_argument("--cpu-share", action=argparse.BooleanOptionalAction, default=d.cpu_share,
                   help="with mapped misses and a policy that computes misses on the CPU: each layer of a denoising "
                        "iteration gives the CPU kernel some of the misses its slots could not keep, computed beside "
                        "the GPU's reads (how many from the measured cost model); the CPU rounds bf16 its own way, so "
                        f"tokens can differ from full's (default {'on' if d.cpu_share else 'off'})")
    g.add_argument("--no-shared-stream", dest="shared_stream", action="store_false",
                   help="compute the shared expert on the main stream, after the routed experts (default: on a "
                        "second CUDA stream beside them, in the all-resident and mapped forwards)")
    g.add_argument("--no-shared-in-moe", dest="shared_in_moe", action="store_false",
                   help="compute the shared expert with GEMMs of its own (default: as one more expert of every "
                        "token in the fused MoE kernels' launches, where those run)")


def add_fused_args(g) -> None:
    """--[no-]fused-X for each Triton kernel and --[no-]fused for all of them; fused_fields turns them into the
    EngineConfig fields (None where not given: on where they compile, docs/decisions.md: triton-kernels)."""
    for name in FUSED_KERNELS:
        default = ("off, asked for only" if name in FUSED_OPT_IN else
                   "on with a CUDA device and Triton, torch's path elsewhere")
        g.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=None,
                       help=f"{FUSED_HELP[name]} (needs Triton and CUDA; default: {default})")
    g.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="--fused: every --fused-* kernel above, asked for (an error where one cannot run); "
                        "--no-fused: torch's kernels everywhere (slower; default: each kernel's own default)")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    d = DecodeParams()
    g = p.add_argument_group("decoding")
    g.add_argument("--gen-length", type=int, default=d.gen_length, help="tokens to generate at most")
    g.add_argument("--block-length", type=int, help="diffusion block size (default: the model's)")
    g.add_argument("--steps", type=int, help="iterations per block of the minimum schedule (default: block; capped "
                                             "at the block length and, for LLaDA2, at --gen-length)")
    g.add_argument("--threshold", type=float, default=d.threshold, help="commit confidence threshold")
    g.add_argument("--rule", default=d.rule, choices=["threshold", "low_confidence"],
                   help="commit rule: every position above the threshold, or LLaDA's fixed steps")
    g.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature (0: greedy)")
    g.add_argument("--sample-seed", dest="sample_seed", type=int,
                   help="sampling seed, with --temperature above 0 (default: 0, the same samples every run)")
    g.add_argument("--cache", default=d.cache, choices=["none", "prefix", "dual"], help="KV cache mode")


def add_special_tokens_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-special-tokens", action="store_true",
                   help="parse special tokens written in the prompt or messages (<|mask|>, <|role_end|>, ...) as "
                        "those tokens (default: off, tokenized as text; only the chat template's markers are special)")


def engine_config(args) -> EngineConfig:
    return EngineConfig(model=args.model, random_weights=args.random_weights, layers=args.layers, seed=args.seed,
                        device=args.device, dtype=args.dtype, expert_budget=args.expert_budget, policy=args.policy,
                        misses=args.misses, waves=args.waves, tide_tau=args.tide_tau, popularity=args.popularity, cpu_threads=args.cpu_threads,
                        torch_threads=getattr(args, "torch_threads", None),
                        pin_memory=args.pin_memory, cuda_graphs=args.cuda_graphs,
                        offload_graphs=args.offload_graphs, mapped_misses=args.mapped_misses,
                        capture_slots=args.capture_slots, cpu_share=args.cpu_share,
                        shared_stream=args.shared_stream, shared_in_moe=args.shared_in_moe,
                        profile=getattr(args, "profile", False),
                        **fused_fields(args), **cpu_kernel_fields(args))


def fused_fields(args) -> dict:
    """The Triton kernels' EngineConfig switches from the flags of add_execution_args (`oled bench` passes them on):
    each --fused-*/--no-fused-* flag, else --fused/--no-fused for all, else None (the engine's default)."""
    return {name: args.fused if getattr(args, name) is None else getattr(args, name) for name in FUSED_KERNELS}


CPU_KERNEL_FIELDS = ("cpu_wake", "cpu_cost_feedback", "cpu_isa", "cpu_amx_min_tokens", "cpu_pin", "cpu_spin_us",
                     "cpu_chunks", "cpu_prefetch", "cpu_prefetch_distance")


def cpu_kernel_fields(args) -> dict:
    """The CPU kernel's EngineConfig fields from the flags of add_execution_args (`oled bench` passes them on)."""
    return {name: getattr(args, name) for name in CPU_KERNEL_FIELDS}


def decode_params(args) -> DecodeParams:
    return DecodeParams(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                        threshold=args.threshold, rule=args.rule, temperature=args.temperature,
                        seed=args.sample_seed, cache=args.cache)
