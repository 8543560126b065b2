"""y = x @ W^T for few rows as one Triton launch: the attention's QKV and output projections, the dense MLPs' and the
shared experts' gate|up and down GEMMs of a decode step (EngineConfig.fused_linear).

cuBLAS's small-tile kernels read these weights well below the HBM's bandwidth at a decode step's few rows. This
kernel aims at reading each weight once at close to that bandwidth: a program owns a few output features (block_n)
for every row of the step and walks the whole reduction dimension (oled/kernels/linear_kernel.py). Each program
also reads all of x (from L2), the price of not splitting K. It did not beat cuBLAS, so the engine leaves it off
unless asked for (Engine.OPT_IN; docs/decisions.md: fused-linear-off); benchmarks/kernels_bench.py's `linear` case
times it against F.linear and --linear-tiles compares tiles.

Semantics: the products are exact (a product of two bf16 or two fp16 values fits in fp32; fp32 operands multiply
as IEEE FMAs, never TF32) and the sums are fp32, in the kernel's own order (K tiles in sequence, each tile's sum in
the tensor cores' order), which is not cuBLAS's; the result is rounded once to x's dtype. So an element can land an
ulp of the output dtype away from F.linear's wherever the exact sum lies close to a rounding boundary, and a model
run with the kernel decodes its own sequence in bf16, as with the other kernels that sum in another order. Every
element lies within an ulp of the correctly rounded exact sum, beyond only where a sum cancels to near 0
(tests/test_triton_linear.py); benchmarks/kernels_bench.py reports the share equal to cuBLAS's on the GPU. The order is fixed (no split-K, no atomics), so every call gives the same bits.

Rows above MAX_ROWS: the callers keep F.linear (a prefill is compute-bound, and cuBLAS's large tiles win there); the
launcher itself takes any number of rows, in blocks of up to 64.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .triton_support import available, check_device, interpreted

__all__ = ["MAX_ROWS", "LinearTiles", "available", "default_tiles", "linear"]

MAX_ROWS = 64           # the model takes the kernel for up to this many rows, F.linear above
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PROGRAMS = 128         # compiled: the feature blocks a call aims for (the H200 has 132 multiprocessors)
_MAX_BLOCK_M = 64       # rows a program: a decode step's 32 or 64 in one block, more rows in several


class LinearTiles(NamedTuple):
    block_n: int        # output features a program (at least 16: a tensor-core tile's side)
    block_k: int        # reduction dims a step
    warps: int
    stages: int         # software-pipeline depth of the K loop (compiled)


def linear(x: torch.Tensor, weight: torch.Tensor, tiles: LinearTiles | None = None) -> torch.Tensor:
    """x [M, K] (rows at any stride, contiguous along K) @ weight [N, K]^T (contiguous) -> [M, N] contiguous, in
    x's dtype (float32, bfloat16 or float16, the weight's too). tiles: None for default_tiles;
    benchmarks/kernels_bench.py --linear-tiles measures others."""
    import triton

    from .linear_kernel import skinny_linear_kernel as kernel

    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] must share K, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"x and weight must share one of float32, bfloat16, float16, got {x.dtype} and "
                        f"{weight.dtype}")
    if (x.stride(1) != 1 and x.shape[1] > 1) or not weight.is_contiguous():
        raise ValueError(f"x must be contiguous along K (strides {x.stride()}) and weight contiguous "
                         f"(strides {weight.stride()})")
    check_device(kernel, x, weight)
    (rows, size), features = x.shape, weight.shape[0]
    out = torch.empty(rows, features, dtype=x.dtype, device=x.device)
    if rows and features:
        tiles = tiles or default_tiles(rows, features, size, interpreted(kernel))
        if tiles.block_n < 16 or tiles.block_k < 16:
            raise ValueError(f"tiles {tiles}: block_n and block_k must be at least 16 (a tensor-core tile)")
        block_m = _block_m(rows)
        kernel[(triton.cdiv(features, tiles.block_n), triton.cdiv(rows, block_m))](
            x, weight, out, rows, features, x.stride(0), out.stride(0),
            K=size, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            INTERPRETED=interpreted(kernel), num_warps=tiles.warps, num_stages=tiles.stages)
    return out


def default_tiles(rows: int, n: int, k: int, interpreting: bool) -> LinearTiles:
    """The tiles for x [rows, k] @ W[n, k]^T. Compiled (chosen by reasoning; only these were timed on the H200):
    - block_n 16, or 32 where that still leaves _PROGRAMS feature blocks (LLaDA2.0-mini's dense gate|up, 10,240
      features): every program reads the whole of x (from L2), so fewer, wider programs read less of it, but
      below about one program a multiprocessor the weight's bytes stream through too few of them. Its 2,048- and
      3,072-feature weights make 128 and 192 programs of 16; the shared expert's gate|up (1,024) only 64.
    - block_k 256 (the width where narrower), 4 stages: three weight tiles of 8 KiB in flight a program while it
      multiplies the fourth, 96 KiB of shared memory with 32 rows of x; 3 stages for 64 rows (120 KiB).
    - 4 warps: a [32, 16] fp32 accumulator is four m16n8 tensor-core tiles, one a warp.
    Interpreted: the cost is per operation, so small tiles, which still split the tests' shapes into several
    feature blocks and K steps."""
    import triton

    if interpreting:
        return LinearTiles(block_n=16, block_k=32, warps=1, stages=1)
    block_n = 32 if triton.cdiv(n, 32) >= _PROGRAMS else 16
    block_k = min(256, max(16, triton.next_power_of_2(k)))
    return LinearTiles(block_n=block_n, block_k=block_k, warps=4, stages=4 if _block_m(rows) <= 32 else 3)


def _block_m(rows: int) -> int:
    """Rows a program: all of a decode step's, rounded up to a power of two, at least the 16 of a tensor-core tile
    (the padding rows are masked, never read)."""
    import triton

    return min(max(16, triton.next_power_of_2(rows)), _MAX_BLOCK_M)
