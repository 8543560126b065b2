"""Engine: builds the model, the expert store, the expert manager and the tokenizer from an EngineConfig."""
from __future__ import annotations

import gc
import importlib
import logging
from dataclasses import replace
from importlib import resources
from pathlib import Path

import torch
from tqdm import tqdm

from .config import FUSED_KERNELS, FUSED_OPT_IN, EngineConfig
from .fp8 import check_expert_dtype
from .decoding.model_runner import ModelRunner
from .decoding.loop import GenerationResult, generate
from .decoding.params import DecodeParams
from .kernels import triton_support
from .loader import CheckpointError, build_empty, load_checkpoint, load_tensors
from .models.config import config_from_dict, load_config
from .policies import make_policy, policy_options
from .policies.spec import PolicySpec
from .runtime.budget import parse_budget, parse_spec
from .runtime.cost_model import CostModel, load_or_measure
from .host_memory import check_host_memory
from .runtime.cpu_kernel import CpuExpertKernel, check_knobs
from .runtime.manager import ExpertManager, check_cpu_wake
from .runtime.threads import plan_threads
from .runtime.timer import SectionTimer
from .synth import build_tokenizer, preset_config, random_tensors
from .tokenizer import Tokenizer

log = logging.getLogger("oled")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
# float16: the CPU expert kernel and the expert store take bf16 or fp32, and the models are trained in bf16 (whose
# range fp16 does not have); refused before anything is built
UNSUPPORTED_DTYPES = ("float16", "fp16", "half")


def pick_device(name: str | None) -> torch.device:
    """The device to run on; CUDA asked for on a machine without it is refused here, in one line."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available here (torch {torch.__version__}, "
                         f"{torch.cuda.device_count()} GPUs visible); use --device cpu")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {name!r}: the engine runs on cuda or cpu")
    return device


def check_dtype(dtype: str | None) -> None:
    """A dtype the engine runs (None: its device's default), else one line."""
    if dtype in UNSUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported: the expert store and the CPU expert kernel take "
                         f"bfloat16 or float32")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")


def default_model_dir() -> Path:
    return Path(str(resources.files("oled").joinpath("assets/tiny-model")))


class Engine:
    def __init__(self, cfg: EngineConfig, progress: bool = False):
        self.cfg = cfg
        spec = PolicySpec.parse(cfg.policy, live=True)      # name:key=value; an unknown name or option refused
        if cfg.waves and "waves" not in policy_options(spec.name):
            raise ValueError(f"--waves applies to oled and oled-coop (their cooperative misses), not {spec.name!r}")
        if cfg.misses is not None and "misses" not in policy_options(spec.name):
            raise ValueError(f"--misses applies to lru, lfu, prefetch and oled-coop; policy {spec.name!r} decides "
                             "its misses itself")
        capture = cfg.offload.capture_slots
        if not isinstance(capture, int) or capture < 0:
            raise ValueError(f"--capture-slots must be an integer >= 0, got {capture!r}")
        check_expert_dtype(cfg.expert_dtype)
        c = cfg.cpu
        check_cpu_wake(c.cpu_wake)        # before anything is loaded
        check_knobs(c.cpu_isa, c.cpu_amx_min_tokens, c.cpu_spin_us, c.cpu_chunks, c.cpu_prefetch_distance)
        parse_spec(cfg.expert_budget)       # its format; against the model's experts once they are known
        options = self._policy_options(cfg, spec)
        make_policy(spec.name, **options)    # its options' values (a popularity file read)
        check_dtype(cfg.dtype)
        self.device = pick_device(cfg.device)
        self.kernels = self._pick_kernels(cfg)       # EngineConfig.fused_*: name -> on
        self.threads = plan_threads(c.torch_threads, c.cpu_threads)
        torch.set_num_threads(self.threads.torch_threads)
        log.info("threads: %s", self.threads.describe())
        self.dtype = DTYPES[cfg.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")]
        pin = cfg.offload.pin_memory and self.device.type == "cuda"
        if cfg.random_weights:
            raw = preset_config(cfg.random_weights, cfg.layers)
            config = config_from_dict(raw)
            check_host_memory(config, self.dtype, self.device, f"preset {cfg.random_weights}", cfg.expert_dtype, pin)
            loaded = build_empty(config, self.dtype, self.device, pin, cfg.expert_dtype)
            gen_device = self.device if self.device.type == "cuda" else "cpu"
            stream = random_tensors(config, cfg.seed, device=gen_device, dtype=self.dtype)
            if progress:
                # disable=None: a bar on a terminal only, so errors stay one line in logs and pipes
                stream = tqdm(stream, desc="random weights", unit="tensor", leave=False, disable=None)
            load_tensors(loaded, stream)
            self.tokenizer = Tokenizer(build_tokenizer(config))
            self.model_name = f"random:{cfg.random_weights}"
        else:
            model_dir = Path(cfg.model) if cfg.model else default_model_dir()
            if not model_dir.is_dir():
                raise CheckpointError(f"{model_dir}: not a directory")
            # The tokenizer is checked against the config first: a mismatch fails before any weight is read.
            config = load_config(model_dir)
            self.tokenizer = Tokenizer.from_dir(model_dir)
            self.tokenizer.check_against(config, source=str(model_dir / "tokenizer.json"))
            check_host_memory(config, self.dtype, self.device, str(model_dir), cfg.expert_dtype, pin)
            loaded = load_checkpoint(model_dir, self.dtype, self.device, pin=pin, progress=progress,
                                     expert_dtype=cfg.expert_dtype)
            self.model_name = model_dir.name
        self.config, self.model, self.store = loaded.config, loaded.model, loaded.store
        self._settle_kernels()
        # the forward's machinery: the model's kernels, the KV cache, the graphs, the manager's wiring
        self.runner = ModelRunner(self.model, cuda_graphs=cfg.offload.cuda_graphs,
                                  offload_graphs=cfg.offload.offload_graphs)
        self.runner.use_kernels(self.kernels, self.model_name)
        self.timer = SectionTimer(self.device) if cfg.profile else None
        self._cpu_kernel = None
        self.costs: CostModel | None = None     # measured miss-service costs, built with the first CPU policy
        self.set_runtime(spec.name, cfg.expert_budget, **options)

    @staticmethod
    def _policy_options(cfg: EngineConfig, spec: PolicySpec) -> dict:
        """The policy's options: those written in --policy name:key=value and those of their own flags, each once."""
        flags = {k: v for k, v in dict(tau=cfg.tide_tau, popularity=cfg.popularity, misses=cfg.misses,
                                       waves=int(cfg.waves) if cfg.waves else None).items() if v is not None}
        twice = sorted(set(flags) & set(spec.options))
        if twice:
            raise ValueError(f"policy {cfg.policy!r} sets {twice[0]!r}, and so does its own flag: give it once")
        return {**flags, **spec.options}

    def set_runtime(self, policy: str, expert_budget, **policy_options) -> None:
        """(Re)build the budget, the policy and the expert manager over the loaded model and expert store, without
        reloading weights (a benchmark sweeps policies and budgets this way). The previous manager's GPU cache pool is
        freed before the new one is allocated. policy_options go to make_policy (tau, popularity: a file path or the
        data itself, ...); options a policy does not take and None values are ignored."""
        old = self.runner.detach()
        if old is not None:
            old.close()
            del old
            gc.collect()                 # the pool's last references may sit in cycles (on the CPU it is host memory)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.budget = parse_budget(expert_budget, num_layers=len(self.config.moe_layers),
                                   num_experts=self.config.num_experts, expert_bytes=self.store.expert_bytes)
        self._check_fits()
        self.policy = make_policy(policy, **policy_options)
        cpu_kernel = None
        if self.policy.uses_cpu:
            if self._cpu_kernel is None:
                c = self.cfg.cpu
                self._cpu_kernel = CpuExpertKernel(
                    num_threads=self.threads.kernel_threads, isa=c.cpu_isa, amx_min_tokens=c.cpu_amx_min_tokens,
                    pin=c.cpu_pin, spin_us=c.cpu_spin_us, chunks=c.cpu_chunks, prefetch=c.cpu_prefetch,
                    prefetch_distance=c.cpu_prefetch_distance)
            cpu_kernel = self._cpu_kernel
            if self.costs is None:
                self.costs = load_or_measure(self.store, cpu_kernel, self.device)
                log.info("miss service: %s", self.costs.describe())
        # the settings as they resolved here: the kernels that run, the mapped path on or off
        manager = ExpertManager(self.store, self.budget, self.policy, self.device, cpu_kernel, self.timer,
                                costs=self.costs if cpu_kernel is not None else None,
                                kernels=replace(self.cfg.kernels, **self.kernels),
                                offload=replace(self.cfg.offload, mapped_misses=self._mapped_misses()),
                                cpu=self.cfg.cpu)
        # read here like the settings above: a benchmark switches segmented graphs between runs (h200_smoke.py)
        self.runner.offload_graphs = self.cfg.offload.offload_graphs
        self.runner.attach(manager)     # graphs hold the pool's addresses and a placement: new ones

    # EngineConfig.fused_* field -> (its kernel module, a kernel of it)
    KERNELS = {"fused_router": ("router_kernel", "sigmoid_group_route_kernel"),
               "fused_moe": ("moe_kernel", "gate_up_kernel"),
               "fused_norm": ("norm_kernel", "add_rms_norm_kernel"),
               "fused_mlp": ("mlp_kernel", "silu_mul_kernel"),
               "fused_confidence": ("confidence_kernel", "scan_kernel"),
               "fused_attention": ("attention_kernel", "attention_kernel"),
               "fused_linear": ("linear_kernel", "skinny_linear_kernel")}
    OPT_IN = FUSED_OPT_IN        # kernels that stay off unless asked for

    def _pick_kernels(self, cfg: EngineConfig) -> dict[str, bool]:
        """Each Triton kernel on or off: as asked (one asked for is checked to run here first), or, left at None,
        on where Triton compiles for this device (the router: once the model is known to route as LLaDA2,
        _settle_kernels), except the OPT_IN ones, off."""
        auto = self.device.type == "cuda" and triton_support.available()
        picked = {}
        for name in FUSED_KERNELS:
            asked = getattr(cfg.kernels, name)
            if asked:
                self._check_triton_runs(f"--{name.replace('_', '-')}", *self.KERNELS[name])
            picked[name] = (auto and name not in self.OPT_IN) if asked is None else bool(asked)
        return picked

    def _mapped_misses(self) -> bool:
        """EngineConfig.mapped_misses, None resolved: on with the fused MoE kernels compiled for CUDA and a pinned
        store (asked for without them, the manager refuses it in one line)."""
        asked = self.cfg.offload.mapped_misses
        if asked is None:
            return self.kernels["fused_moe"] and self.device.type == "cuda" and self.store.pinned
        return asked

    def _settle_kernels(self) -> None:
        """The kernels that depend on the model, once it is loaded: the fused router implements LLaDA2's routing
        only, so left at its default it is off for another model's (asked for, that is an error)."""
        if self.cfg.kernels.fused_router is None and self.config.router != "sigmoid_group":
            self.kernels["fused_router"] = False

    def _check_triton_runs(self, flag: str, module: str, kernel: str) -> None:
        """Before any loading: Triton is there and can run `flag`'s kernel (oled.kernels.<module>.<kernel>) on
        this device."""
        if not triton_support.available():
            raise ValueError(f"{flag} needs Triton and a CUDA device (or TRITON_INTERPRET=1 for Triton's CPU "
                             "interpreter)")
        if self.device.type != "cuda":
            fn = getattr(importlib.import_module(f".kernels.{module}", __package__), kernel)
            if not triton_support.interpreted(fn):
                raise ValueError(f"{flag} needs a CUDA device (the engine runs on {self.device}), or "
                                 f"TRITON_INTERPRET=1")

    def set_routing_source(self, source) -> None:
        """Every MoE layer takes its routing from `source` (a TraceSource; None: from its router)."""
        self.runner.set_routing_source(source)

    @property
    def manager(self) -> ExpertManager | None:
        """The runtime's expert manager: the one the model runner has wired into the MoE layers."""
        return self.runner.manager

    @property
    def graphs(self):
        """The runner's CUDA graphs (None: every forward eager)."""
        return self.runner.graphs

    def _check_fits(self) -> None:
        if self.device.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(self.device)
        if self.budget.bytes > free:
            raise ValueError(f"expert budget {self.budget.bytes / 2**30:.1f} GiB does not fit in the "
                             f"{free / 2**30:.1f} GiB free on {self.device}")

    @property
    def cache_place(self) -> str:
        """Where the expert cache's slots live, in words (the budget's line)."""
        return "on the GPU" if self.device.type == "cuda" else f"in the expert cache ({self.device.type.upper()})"

    @property
    def non_expert_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def generate_ids(self, prompt_ids: list[int], params: DecodeParams, on_block=None,
                     cancelled=None) -> GenerationResult:
        params.validate()
        return generate(self.runner, prompt_ids, params, on_block=on_block, timer=self.timer, cancelled=cancelled)

    def describe(self) -> str:
        return (f"{self.model_name} ({self.config.model_type}, {self.config.num_layers} layers, "
                f"{self.config.num_experts} experts/layer) on {self.device} {str(self.dtype).replace('torch.', '')}; "
                f"policy {self.policy.name}; {self.budget.describe(self.cache_place)}; non-expert weights "
                f"{self.non_expert_bytes / 2**30:.2f} GiB; host experts {self.store.host_bytes / 2**30:.2f} GiB"
                f"{' fp8' if self.store.fp8 else ''}"
                f"{' pinned' if self.store.pinned else ''}; Triton kernels: "
                + (", ".join(n.removeprefix("fused_") for n, on in self.kernels.items() if on) or "none")
                + (f"; miss service: {self.manager.costs.describe()}" if self.manager.costs is not None else ""))
