"""Triton kernel: SiLU(gate) * up from one [T, 2I] gate|up GEMM output, for the dense MLPs and the shared expert.

Imports Triton unconditionally; only oled.kernels.triton_mlp imports this module, and only when Triton is
available. The launcher and the semantics are documented there.
"""
import triton
import triton.language as tl

from .kernel_math import round_to, silu


@triton.jit
def silu_mul_kernel(
    h_ptr, out_ptr, h_row_stride, out_row_stride, inter,
    BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Grid (rows, column tiles): out[t, n] = silu(h[t, n]) * h[t, inter + n], with torch's roundings: the SiLU
    rounded to the storage dtype, then the product (bf16 on the bits, so no FMA can merge them)."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    here = n < inter
    gate = tl.load(h_ptr + t * h_row_stride + n, mask=here, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + t * h_row_stride + inter + n, mask=here, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = round_to(round_to(silu(gate, INTERPRETED), dtype, True) * up, dtype, True)
    tl.store(out_ptr + t * out_row_stride + n, act.to(dtype), mask=here)
