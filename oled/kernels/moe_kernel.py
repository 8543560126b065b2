"""Triton kernels: SwiGLU experts over slot-aligned blocks of (token, expert) pairs, straight from the slot pool.

Imports Triton unconditionally; only oled.kernels.triton_moe imports this module, and only when Triton is
available. The launcher, the layout and the rounding are documented there.

Both kernels take a grid of (row block, column tile). A program owns BLOCK_M rows of one slot (from
oled/kernels/moe_align_kernel.py) and BLOCK_N output columns, and walks the whole reduction dimension in
BLOCK_K steps in one fixed order; a row's result depends only on its own input row and its slot's weights,
never on the other rows of its block, so it does not depend on which other pairs or experts share the call.
HIDDEN and INTER are constexprs (one compilation per model shape): the K loops have static trip counts, which
Triton software-pipelines, and which the interpreter can run (not a runtime-bound `for`, triton-lang/triton#9171).
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _silu(x, INTERPRETED: tl.constexpr):
    """x / (1 + exp(-x)) in fp32, as torch's CUDA silu computes it (expf, IEEE division) when compiled; the
    interpreter has no libdevice and takes numpy's exp."""
    if INTERPRETED:
        e = tl.exp(-x)
    else:
        e = libdevice.exp(-x)
    return tl.math.div_rn(x, 1.0 + e)


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr):
    """acc + a @ b with fp32 accumulation. The interpreter's dot multiplies bf16 as raw uint16, so there the
    operands are widened first: exact (a product of two bf16 or fp16 values fits in fp32), so only the order of
    the fp32 sums can differ from the tensor cores'."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _round(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 rounded to `dtype` (to nearest, ties to even) and widened back: where the torch path stores a value in
    x's dtype. The interpreter's fp32 -> bf16 cast truncates, so there bf16 is rounded on the bits (finite
    values; a compiled cast rounds to nearest even itself)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def gate_up_kernel(
    x_ptr, pool_ptr, sorted_pairs_ptr, block_slots_ptr, act_ptr,
    x_row_stride, pool_row_stride, top_k,
    HIDDEN: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """act[row, n] = silu(x[token] . gate[n]) * (x[token] . up[n]) for the block's rows and BLOCK_N columns n of
    the intermediate, in one pass over the hidden dimension (gate and up tiles read side by side).

    Rows are in sorted_pairs' order; act has num_blocks * BLOCK_M rows of INTER (padding rows get zeros).
    """
    block = tl.program_id(0)
    slot = tl.load(block_slots_ptr + block)
    if slot < 0:                # past the last slot's rows: the static grid's spare blocks
        return
    row = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + row)
    has_pair = (pair >= 0)[:, None]
    token = tl.where(pair >= 0, pair // top_k, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)

    # the blob's gate rows [INTER, HIDDEN] then up rows: tile [BLOCK_K, BLOCK_N] of gate^T and of up^T
    gate_ptrs = pool_ptr + slot.to(tl.int64) * pool_row_stride + n[None, :] * HIDDEN + k[:, None]
    up_ptrs = gate_ptrs + INTER * HIDDEN
    x_ptrs = x_ptr + token[:, None] * x_row_stride + k[None, :]
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        xs = tl.load(x_ptrs + k0, mask=has_pair, other=0.0)
        acc_gate = _dot(xs, tl.load(gate_ptrs + k0), acc_gate, INTERPRETED)
        acc_up = _dot(xs, tl.load(up_ptrs + k0), acc_up, INTERPRETED)

    # the torch path's rounding points: h = x @ gate_up^T in x's dtype, silu(h_gate) in x's dtype, then the
    # product rounded once more (no-ops in fp32)
    dtype = act_ptr.dtype.element_ty
    gate = _round(acc_gate, dtype, INTERPRETED)
    act = _round(_silu(gate, INTERPRETED), dtype, INTERPRETED) * _round(acc_up, dtype, INTERPRETED)
    tl.store(act_ptr + row[:, None] * INTER + n[None, :], _round(act, dtype, INTERPRETED).to(dtype))


@triton.jit
def down_kernel(
    act_ptr, pool_ptr, sorted_pairs_ptr, block_slots_ptr, out_ptr,
    pool_row_stride, out_row_stride,
    HIDDEN: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """out[pair, n] = act[row] . down[n] for the block's rows that hold a pair and BLOCK_N columns n of the
    hidden dimension: written straight to the pair's row of out, every other row of out untouched."""
    block = tl.program_id(0)
    slot = tl.load(block_slots_ptr + block)
    if slot < 0:
        return
    row = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + row)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)

    # the blob's down matrix [HIDDEN, INTER] after gate and up: tile [BLOCK_K, BLOCK_N] of down^T
    down_ptrs = pool_ptr + slot.to(tl.int64) * pool_row_stride + 2 * INTER * HIDDEN + n[None, :] * INTER + k[:, None]
    act_ptrs = act_ptr + row[:, None] * INTER + k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        acc = _dot(tl.load(act_ptrs + k0), tl.load(down_ptrs + k0), acc, INTERPRETED)

    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * out_row_stride + n[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptrs, _round(acc, dtype, INTERPRETED).to(dtype), mask=(pair >= 0)[:, None])
