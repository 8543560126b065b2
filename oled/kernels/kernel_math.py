"""Triton helpers the kernels share: an exact-product dot, rounding where the torch reference stores a value, and
torch's SiLU.

Imports Triton unconditionally; only the kernel modules import it, and only when Triton is available.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def silu(x, INTERPRETED: tl.constexpr):
    """x / (1 + exp(-x)) in fp32, as torch's CUDA silu computes it (expf, IEEE division) when compiled; the
    interpreter has no libdevice and takes numpy's exp."""
    if INTERPRETED:
        e = tl.exp(-x)
    else:
        e = libdevice.exp(-x)
    return tl.math.div_rn(x, 1.0 + e)


@triton.jit
def round_to(x, dtype: tl.constexpr, BY_BITS: tl.constexpr):
    """fp32 rounded to `dtype` (to nearest, ties to even) and widened back: where the torch path stores a value in
    its dtype. BY_BITS rounds bf16 on the bits (add half an ulp and the parity bit, drop the low half; finite values
    and infinities); otherwise a cast pair. The interpreter needs the bits (its cast truncates, whatever rounding
    mode is asked for). Compiled, a cast pair lets the compiler turn `round(a * b) + round(c)` into one bf16 FMA
    that skips the product's rounding (seen in qk_norm_rope's PTX, where 7.5 % of the H200's outputs then differed
    from torch's), so a kernel that multiplies and then adds rounded values takes the bits there too."""
    if BY_BITS and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def exact_dot(a, b, acc, WIDEN: tl.constexpr):
    """acc + a @ b with fp32 accumulation and exact products: two bf16 (or two fp16) operands as they are (their
    product fits in fp32) on the tensor cores, so only the order of the fp32 sums can differ from another GEMM's;
    with WIDEN both widened to fp32 and multiplied as IEEE FMAs (never TF32): for fp32 or mixed operands, and under
    the interpreter, whose dot multiplies bf16 as raw uint16."""
    if WIDEN:       # (an `else`: Triton compiles what follows a constexpr-true `if ... return` as well)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc
