"""Flags shared by the commands that load a model: the engine's, generated from EngineConfig's fields, and
DecodeParams'."""
from __future__ import annotations

import argparse
import inspect
from dataclasses import fields

from ..config import FUSED_KERNELS, SECTIONS, EngineConfig, KernelConfig, setting_fields
from ..decoding.params import DecodeParams
from ..policies import policy_class
from ..policies.spec import PolicySpec, live_policies

LIVE_POLICIES = live_policies()      # belady: replay only
TIDE_TAU = inspect.signature(policy_class("tide")).parameters["tau"].default         # tide's own default
FIELDS = {f.name: f for f in setting_fields()}
TOP_LEVEL = [f.name for f in fields(EngineConfig) if f.name not in SECTIONS]
TYPES = {"int": int, "float": float, "str": str}
# help that only the CLI can word: the policies' names and defaults live with the policies
HELP = {"policy": f"expert residency policy, with options as name:key=value (oled:decay=0.5); one of "
                  f"{', '.join(LIVE_POLICIES)} (default: %(default)s)",
        "tide_tau": f"tide: refresh period in iterations (default: {TIDE_TAU})"}


def add_engine_args(p: argparse.ArgumentParser, skip=(), helps=None) -> None:
    """The engine's flags, generated from EngineConfig's fields (oled/config.py): the top-level settings under
    "model and runtime", each group of settings under its own heading; `skip`: settings the command does not take,
    `helps`: help texts in the command's words."""
    add_settings(p.add_argument_group("model and runtime"), TOP_LEVEL, skip, helps)
    for name, cls in SECTIONS.items():
        g = p.add_argument_group(f"{name}: {cls.__doc__.split(';')[0]}")
        if cls is KernelConfig:
            add_fused_args(g)
        add_settings(g, [f.name for f in fields(cls) if f.name not in FUSED_KERNELS], skip, helps)


def add_settings(g, names, skip=(), helps=None) -> None:
    """One flag per setting: --name for a value (its type, choices and minimum from the field), --name for a
    setting off by default, --no-name for one on by default, --name/--no-name for one that may be left undecided
    (None) or is declared `both`."""
    for name in names:
        f = FIELDS[name]
        meta = f.metadata
        if name in skip or not meta["cli"]:
            continue
        kwargs = {"dest": name, "help": (helps or {}).get(name, HELP.get(name, meta["help"]))}
        kind = f.type.replace(" | None", "")
        if kind == "bool" and (f.default is None or meta["both"]):
            kwargs.update(action=argparse.BooleanOptionalAction, default=f.default)
        elif kind == "bool":
            kwargs.update(action="store_false" if f.default else "store_true")
        else:
            kwargs.update(default=f.default, type=TYPES[kind], choices=meta["choices"], metavar=meta["metavar"])
            if meta["minimum"] is not None:
                kwargs["type"] = at_least(meta["minimum"], TYPES[kind])
        negated = kind == "bool" and f.default is True
        flag = meta["flag"] or ("--no-" if negated else "--") + name.replace("_", "-")
        g.add_argument(flag, **kwargs)


def add_fused_args(g) -> None:
    """--[no-]fused-X for each Triton kernel and --[no-]fused for all of them; fused_fields turns them into the
    settings."""
    add_settings(g, FUSED_KERNELS)
    g.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="--fused: every --fused-* kernel above, asked for (an error where one cannot run); "
                        "--no-fused: torch's kernels everywhere (slower; default: each kernel's own default)")


def at_least(minimum: int, kind):
    """argparse type for a count that must be at least `minimum` (layers, threads: 0 would divide by zero or do
    nothing)."""
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    check.__name__ = f"at_least_{minimum}"
    return check


positive_int = at_least(1, int)


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
    """The EngineConfig of a command's flags: every setting it has a flag for, the Triton kernels' switches resolved
    with --fused; the policy and its options are checked here, before anything is loaded."""
    given = {f.name: getattr(args, f.name) for f in setting_fields() if f.metadata["cli"] and hasattr(args, f.name)}
    cfg = EngineConfig(**{**given, **fused_fields(args)})
    PolicySpec.parse(cfg.policy, live=True)
    return cfg


def fused_fields(args) -> dict:
    """The Triton kernels' switches from the flags: each --fused-*/--no-fused-* flag, else --fused/--no-fused for
    all, else None (the engine's default)."""
    return {name: args.fused if getattr(args, name) is None else getattr(args, name) for name in FUSED_KERNELS}


def decode_params(args) -> DecodeParams:
    return DecodeParams(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                        threshold=args.threshold, rule=args.rule, temperature=args.temperature,
                        seed=args.sample_seed, cache=args.cache)
