"""LLaDA2 routing in one Triton launch after the gate GEMM: a drop-in for oled.models.router.sigmoid_group_route.

The kernel (oled/kernels/router_kernel.py) takes the fp32 gate logits and does everything else in one program
per token (compiled; a block of tokens under the interpreter): sigmoid, + expert_bias for selection, group scores (sum of the top 2 in each group), the best
`topk_group` groups, top-k experts among them, weights = unbiased scores renormalised and scaled.

The gate GEMM stays a torch matmul, computed exactly as the reference computes it: bit-identical logits are what
makes the expert ids identical (a Triton GEMM would sum in another order and move near-ties).

Ids are the reference's ids, in its order (descending biased score, as torch.topk(sorted=True)). Ties: every
selection in the kernel takes the lowest index among equal values (expert, and group for the group limit);
torch.topk leaves tie order unspecified (on the CPU it is not lowest-index), so rows with exactly equal biased
scores at a selection boundary may differ in order or membership from the reference while being an equally valid
top-k. With random fp32 scores that is about one token in 30,000. Exactness also needs the kernel's sigmoid to
give torch's bits: compiled for CUDA it computes what torch's CUDA kernel computes (libdevice expf, IEEE division;
benchmarks/kernels_bench.py checks the ids on the GPU). Under the CPU interpreter numpy's exp differs from torch's
CPU exp in the last ulp for some inputs, so scores within an ulp of each other can swap there (1 token of 102,400
differed in one run on random N(0, 1) logits; tests/test_triton_kernels.py keeps its inputs clear of near-ties).

Logits must be finite (NaN ordering is not reproduced).
"""
from __future__ import annotations

import torch

from ..models.router import gate_logits
from .triton_support import available, check_device, interpreted

__all__ = ["available", "sigmoid_group_route", "sigmoid_group_route_logits"]

# widths that load as-is and widen exactly in the kernel; any other bias dtype is converted by torch first
_BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sigmoid_group_route(hidden: torch.Tensor, weight: torch.Tensor, expert_bias: torch.Tensor | None,
                        **routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and results as oled.models.router.sigmoid_group_route (see the module docstring on ties): its
    gate GEMM, then the kernel. hidden [T, H], weight [E, H], expert_bias [E] or None; routing: top_k, n_group,
    topk_group, routed_scaling_factor, norm_topk_prob -> ids [T, k] int64, weights [T, k] fp32."""
    return sigmoid_group_route_logits(gate_logits(hidden, weight), expert_bias, **routing)


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
    import triton

    from .router_kernel import sigmoid_group_route_kernel as kernel

    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise TypeError(f"logits must be [T, E] fp32, got {tuple(logits.shape)} {logits.dtype}")
    num_tokens, num_experts = logits.shape
    groups = max(n_group, 1)
    _check_shape(num_experts, top_k, groups, topk_group)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    bias = expert_bias
    if bias is not None:
        if bias.shape != (num_experts,):
            raise ValueError(f"expert_bias must be [{num_experts}], got {tuple(bias.shape)}")
        bias = (bias if bias.dtype in _BIAS_DTYPES else bias.float()).contiguous()
    check_device(kernel, logits, *([bias] if bias is not None else []))

    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return ids, weights
    group_size = num_experts // groups
    rows = _rows_per_program(num_tokens, interpreted(kernel))
    kernel[(triton.cdiv(num_tokens, rows),)](
        logits, logits if bias is None else bias, ids, weights,
        num_tokens, logits.stride(0), float(routed_scaling_factor),
        N_GROUP=groups, GROUP_SIZE=group_size, TOPK_GROUP=topk_group if groups > 1 else 1, TOP_K=top_k, BLOCK_T=rows,
        BLOCK_G=triton.next_power_of_2(groups), BLOCK_S=triton.next_power_of_2(group_size),
        BLOCK_K=triton.next_power_of_2(top_k),
        HAS_BIAS=bias is not None, NORMALISE=bool(norm_topk_prob and top_k > 1),
        PRECISE=not interpreted(kernel),
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
