"""Kernel launches of a forward, counted on the CPU: every aten op that would launch a device kernel (views,
allocations and metadata ops excluded) and every Triton kernel launch, run under Triton's interpreter (whose own
numpy-backed tensor ops are not counted). A proxy for the profiler's count on the H200, where cuBLAS or attention
may launch more than one kernel for an op and the profiler counts copies too; good for comparing two paths and for
catching launches that creep back (tests/test_launch_budget.py).

    TRITON_INTERPRET=1 python benchmarks/launch_count.py [--kernels all|none|fused_router,fused_moe,...]
        [--preset tiny] [--dtype bfloat16] [--gen-length 32]

Prints the launches per forward (prefill and cache fills included) by op, and their total. --kernels names
EngineConfig's fused_* fields to turn on (all: every one this checkout has).
"""
from __future__ import annotations

import argparse
import contextlib
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# ops that launch nothing on a device: views, allocations, metadata
NO_KERNEL = {
    "view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "split", "split_with_sizes", "slice", "select",
    "as_strided", "expand", "alias", "detach", "permute", "unbind", "reshape", "_reshape_alias", "lift_fresh",
    "empty", "empty_strided", "new_empty", "empty_like", "set_", "is_nonzero", "_local_scalar_dense", "item",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size", "stride", "is_same_size",
}


class _AtenOps(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts, self.paused = counts, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if name in ("to", "_to_copy") and out.data_ptr() == args[0].data_ptr():
            return out                      # a no-op conversion returns (a view of) its input: no launch
        if not self.paused and name not in NO_KERNEL:
            self.counts[name] += 1
        return out


@contextlib.contextmanager
def count_launches():
    """with count_launches() as counts: ... -> counts: Counter of aten op names and 'triton:<kernel>' launches."""
    from triton.runtime.interpreter import InterpretedFunction

    counts = Counter()
    mode = _AtenOps(counts)
    run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        counts[f"triton:{self.__name__}"] += 1
        mode.paused += 1                    # the interpreter's copies in and out are not the kernel's launches
        try:
            return run(self, *args, **kwargs)
        finally:
            mode.paused -= 1

    InterpretedFunction.run = counted_run
    try:
        with mode:
            yield counts
    finally:
        InterpretedFunction.run = run


def fused_fields() -> list[str]:
    from oled.config import FUSED_KERNELS

    return list(FUSED_KERNELS)


def count_forward(kernels: list[str], preset="tiny", dtype="bfloat16", gen_length=32, policy="full",
                  budget="1.0") -> tuple[Counter, int]:
    """Launches of one generate (the request's KV cache allocation left out) and its number of forwards."""
    import oled
    from oled.decoding.params import DecodeParams

    llm = oled.LLM(random_weights=preset, device="cpu", dtype=dtype, policy=policy, expert_budget=budget,
                   **{name: name in kernels for name in fused_fields()})
    ids = llm.tokenizer.encode("def fib(n):\n")
    params = DecodeParams(gen_length=gen_length, block_length=min(gen_length, 32))
    with count_launches() as counts:
        res = llm.engine.generate_ids(ids, params)
    counts.pop("zeros", None)               # the request's KV cache, not a forward's
    return counts, res.nfe + res.cache_forwards


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="all", help="all, none, or EngineConfig fused_* fields, comma-separated")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gen-length", type=int, default=32)
    args = ap.parse_args(argv)
    available = fused_fields()
    kernels = {"all": available, "none": []}.get(args.kernels, [k for k in args.kernels.split(",") if k])
    unknown = set(kernels) - set(available)
    if unknown:
        ap.error(f"unknown kernels {sorted(unknown)}; this checkout has {', '.join(available)}")
    counts, forwards = count_forward(kernels, args.preset, args.dtype, args.gen_length)
    print(f"{args.preset} {args.dtype}, kernels: {', '.join(kernels) or 'none'}; {forwards} forwards; "
          f"launches per forward: {sum(counts.values()) / forwards:.1f}")
    for name, n in counts.most_common():
        print(f"  {n / forwards:7.2f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
