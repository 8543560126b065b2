"""The SwiGLU MLPs (the dense layers and the shared expert) in three launches: one GEMM over gate and up stacked
([gate; up] weights, made once by SwiGLU.use_fused), SiLU(gate) * up in one Triton launch, the down GEMM
(EngineConfig.fused_mlp). The torch path is five: two GEMMs, the SiLU, the product, the down GEMM.

The roundings are torch's: h in the model dtype, the SiLU rounded (computed in fp32, expf and an IEEE division
compiled, as torch's CUDA silu), then the product. The stacked GEMM is one cuBLAS call where torch made two, so its
fp32 sums may run in another order: an element of h can land an ulp away.
"""
from __future__ import annotations

import torch

from .triton_support import available, check_device, interpreted

__all__ = ["available", "silu_mul"]


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """h [T, 2I] (gate columns, then up) -> silu(gate) * up [T, I], in h's dtype."""
    import triton

    from .mlp_kernel import silu_mul_kernel

    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"h must be [T, 2I], got {tuple(h.shape)}")
    h = h if h.stride(-1) == 1 else h.contiguous()
    check_device(silu_mul_kernel, h)
    rows, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    if rows and inter:
        block = min(triton.next_power_of_2(inter), 1024)
        silu_mul_kernel[(rows, triton.cdiv(inter, block))](
            h, out, h.stride(0), out.stride(0), inter, BLOCK=block, INTERPRETED=interpreted(silu_mul_kernel),
            num_warps=4)
    return out
