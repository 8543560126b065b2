"""LLaDA2 routing in two Triton launches: a drop-in for oled.models.router.sigmoid_group_route.

The gate GEMM (`gate_partials_kernel`, oled/kernels/router_kernel.py) computes the fp32 gate logits from the hidden
states and the router weight as they are stored (bf16 in the published checkpoints): the products are exact (a
bf16 product fits in fp32; fp32 operands multiply as IEEE FMAs, never TF32) and the sums fp32, in partial sums over
ranges of the hidden dimension so that a 32-token decode step spreads over ~128 programs. The routing kernel adds
the partials in order and does everything else in one program per token (compiled; a block of tokens under the
interpreter): sigmoid, + expert_bias for selection, group scores (sum of the top 2 in each group), the best
`topk_group` groups, top-k experts among them, weights = unbiased scores renormalised and scaled. torch's path
(the reference) is a cast of the hidden states, cuBLAS's fp32 SIMT GEMM and its split-K reduction, in three
launches.

The logits are the reference's up to the order of the fp32 sums (a few ulps), so the expert ids are the
reference's except where two biased scores lie within those ulps of each other at a selection boundary (a near-tie:
either choice is a valid top-k of the exact scores; benchmarks/kernels_bench.py counts such rows on the GPU).
`sigmoid_group_route_logits` routes from given logits and gives the reference's ids on them exactly.

Ids are in the reference's order (descending biased score, as torch.topk(sorted=True)). Ties: every
selection in the kernel takes the lowest index among equal values (expert, and group for the group limit);
torch.topk leaves tie order unspecified (on the CPU it is not lowest-index), so rows with exactly equal biased
scores at a selection boundary may differ in order or membership from the reference while being an equally valid
top-k. Exactness also needs the kernel's sigmoid to
give torch's bits: compiled for CUDA it computes what torch's CUDA kernel computes (libdevice expf, IEEE division;
benchmarks/kernels_bench.py checks the ids on the GPU). Under the CPU interpreter numpy's exp differs from torch's
CPU exp in the last ulp for some inputs, so scores within an ulp of each other can swap there
(tests/test_triton_kernels.py keeps its inputs clear of near-ties).

Logits must be finite (NaN ordering is not reproduced).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .triton_support import available, check_device, interpreted

__all__ = ["available", "gate_partials", "sigmoid_group_route", "sigmoid_group_route_logits"]

# widths that load as-is and widen exactly in the kernel; any other bias dtype is converted by torch first
_BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# operand dtypes the gate kernel reads as they are
_GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# compiled: programs the gate GEMM aims for (the H200 has 132 multiprocessors), and its tiles
_GATE_PROGRAMS, _GATE_BLOCK_E, _GATE_BLOCK_K = 128, 32, 128


def sigmoid_group_route(hidden: torch.Tensor, weight: torch.Tensor, expert_bias: torch.Tensor | None,
                        **routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and results as oled.models.router.sigmoid_group_route (see the module docstring on near-ties):
    the gate kernel's partial logits, then the routing kernel. hidden [T, H], weight [E, H] (float32, bfloat16 or
    float16 each), expert_bias [E] or None; routing: top_k, n_group, topk_group, routed_scaling_factor,
    norm_topk_prob -> ids [T, k] int64, weights [T, k] fp32."""
    return _route(gate_partials(hidden, weight), expert_bias, **routing)


def gate_partials(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [T, H] @ weight [E, H]^T in fp32 (exact products, fp32 sums) as [splits, T, E] partial sums over
    ranges of H, one launch; their sum in split order is the routing kernel's logits."""
    import triton

    from .router_kernel import gate_partials_kernel as kernel

    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [T, H] and weight [E, H] must share H, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype not in _GATE_DTYPES or weight.dtype not in _GATE_DTYPES:
        raise TypeError(f"hidden and weight must be float32, bfloat16 or float16, got {hidden.dtype} and "
                        f"{weight.dtype}")
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    check_device(kernel, hidden, weight)
    (tokens, size), experts = hidden.shape, weight.shape[0]
    tiles = _gate_tiles(tokens, experts, size, interpreted(kernel))
    splits = triton.cdiv(size, tiles.k_per_split)
    out = torch.empty(splits, tokens, experts, dtype=torch.float32, device=hidden.device)
    if tokens and experts:
        kernel[(triton.cdiv(tokens, tiles.block_t), triton.cdiv(experts, tiles.block_e), splits)](
            hidden, weight, out, tokens, experts, size, hidden.stride(0), weight.stride(0), tokens * experts,
            BLOCK_T=tiles.block_t, BLOCK_E=tiles.block_e, BLOCK_K=tiles.block_k, K_PER_SPLIT=tiles.k_per_split,
            WIDEN=interpreted(kernel) or hidden.dtype != weight.dtype or hidden.dtype == torch.float32, num_warps=4)
    return out


class _GateTiles(NamedTuple):
    block_t: int
    block_e: int
    block_k: int
    k_per_split: int    # a multiple of block_k


def _gate_tiles(tokens: int, experts: int, size: int, interpreting: bool) -> _GateTiles:
    """Compiled: 32 experts and up to 64 tokens a program, 128 hidden dims a step, and the hidden dimension split
    until the grid has about _GATE_PROGRAMS programs (a decode step of 32 tokens over 256 experts and 2,048 dims:
    8 expert blocks x 16 splits of one step each; a 2,048-token prefill: 32 x 8 blocks, no split). Interpreted:
    small tiles (the cost is per operation) and at most 2 steps a split, so the tests' shapes run several splits."""
    import triton

    block_t = min(max(16, triton.next_power_of_2(tokens)), 64)
    if interpreting:
        block_e, block_k, steps = min(max(16, triton.next_power_of_2(experts)), 64), 16, 2
    else:
        blocks = triton.cdiv(tokens, block_t) * triton.cdiv(experts, _GATE_BLOCK_E)
        block_e, block_k = _GATE_BLOCK_E, _GATE_BLOCK_K
        steps = triton.cdiv(triton.cdiv(size, block_k), max(1, _GATE_PROGRAMS // blocks))
    return _GateTiles(block_t, block_e, block_k, block_k * max(1, min(steps, triton.cdiv(size, block_k))))


def sigmoid_group_route_logits(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing from gate logits [T, E] fp32: one kernel launch (plus a bias cast for an fp64 bias)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise TypeError(f"logits must be [T, E] fp32, got {tuple(logits.shape)} {logits.dtype}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _route(logits.unsqueeze(0), expert_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                  routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob)


def _route(partials: torch.Tensor, expert_bias: torch.Tensor | None, *, top_k: int, n_group: int, topk_group: int,
           routed_scaling_factor: float, norm_topk_prob: bool = True):
    """The routing kernel over logits = the sum of partials [splits, T, E] fp32 over splits, in order (rows may be
    strided, experts contiguous)."""
    import triton

    from .router_kernel import sigmoid_group_route_kernel as kernel

    splits, num_tokens, num_experts = partials.shape
    groups = max(n_group, 1)
    _check_shape(num_experts, top_k, groups, topk_group)
    bias = expert_bias
    if bias is not None:
        if bias.shape != (num_experts,):
            raise ValueError(f"expert_bias must be [{num_experts}], got {tuple(bias.shape)}")
        bias = (bias if bias.dtype in _BIAS_DTYPES else bias.float()).contiguous()
    check_device(kernel, partials, *([bias] if bias is not None else []))

    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=partials.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=partials.device)
    if num_tokens == 0:
        return ids, weights
    group_size = num_experts // groups
    rows = _rows_per_program(num_tokens, interpreted(kernel))
    kernel[(triton.cdiv(num_tokens, rows),)](
        partials, partials if bias is None else bias, ids, weights,
        num_tokens, partials.stride(1), partials.stride(0), float(routed_scaling_factor),
        N_GROUP=groups, GROUP_SIZE=group_size, TOPK_GROUP=topk_group if groups > 1 else 1, TOP_K=top_k, BLOCK_T=rows,
        BLOCK_G=triton.next_power_of_2(groups), BLOCK_S=triton.next_power_of_2(group_size),
        BLOCK_K=triton.next_power_of_2(top_k),
        HAS_BIAS=bias is not None, NORMALISE=bool(norm_topk_prob and top_k > 1),
        PRECISE=not interpreted(kernel), SPLITS=splits,
        # one warp holds a 256-expert row in 8 registers per lane; reductions stay within the warp
        num_warps=1 if num_experts <= 512 else 4,
    )
    return ids, weights


def _rows_per_program(num_tokens: int, interpreting: bool) -> int:
    """Compiled: one token row per single-warp program (2,048 rows are one wave of resident blocks on an H200,
    and every reduction stays a warp shuffle). Interpreted: the cost is per operation, not per element, so many
    rows a program."""
    import triton

    return min(triton.next_power_of_2(num_tokens), 64) if interpreting else 1


def _check_shape(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Reject shapes the reference fails on (view, topk) or would fill with masked-out experts."""
    if num_experts % n_group:
        raise ValueError(f"{num_experts} experts do not split into {n_group} groups")
    if n_group > 1:
        if num_experts // n_group < 2:
            raise ValueError("a group score sums two experts: each group needs at least 2")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be in [1, {n_group}], got {topk_group}")
        if not 1 <= top_k <= topk_group * (num_experts // n_group):
            raise ValueError(f"top_k {top_k} exceeds the {topk_group * (num_experts // n_group)} kept experts")
    elif not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
