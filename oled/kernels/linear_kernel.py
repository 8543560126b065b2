"""Triton kernel: y = x @ W^T for a few rows of x (a decode step's), reading the weight once.

Imports Triton unconditionally; only oled.kernels.triton_linear imports this module, and only when Triton is
available. The launcher, the tiles and the semantics are documented there.

A program owns BLOCK_N output features (BLOCK_N rows of W) for a block of BLOCK_M rows of x (all of them in a decode
step) and walks the whole reduction dimension K in BLOCK_K steps in one fixed order, accumulating in fp32. No
split-K and no atomics: an element's sums run in the same order on every call, whichever programs run beside it,
so graph replays and repeated calls give the same bits. K is a constexpr (one compilation per weight width): the K
loop has a static trip count, which Triton software-pipelines and which the interpreter can run (not a
runtime-bound `for`, triton-lang/triton#9171), and the weight's row stride (K itself) is known to the compiler, so
its tiles load as 16-byte vectors.
"""
import triton
import triton.language as tl

from .kernel_math import exact_dot, round_to


@triton.jit
def skinny_linear_kernel(
    x_ptr, w_ptr, out_ptr, num_rows, num_features, x_row_stride, out_row_stride,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Grid (feature blocks, row blocks): program (f, r) writes out[rows, features] = x[rows] @ w[features]^T for
    rows r * BLOCK_M .. and features f * BLOCK_N .., rounded once to out's dtype.

    x [num_rows, K] (rows num_rows apart by x_row_stride, contiguous along K), w [num_features, K] contiguous,
    out [num_rows, num_features] (rows out_row_stride apart). Rows and features past the ends are masked, as are
    the dims of a last K tile past K (their zeros add nothing to the sums).
    """
    row = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    feature = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, feature_ok = row < num_rows, feature < num_features
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + row.to(tl.int64)[:, None] * x_row_stride + k[None, :]           # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + feature.to(tl.int64)[None, :] * K + k[:, None]                  # [BLOCK_K, BLOCK_N] of W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + k < K
        xs = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        ws = tl.load(w_ptrs + k0, mask=feature_ok[None, :] & k_ok[:, None], other=0.0)
        acc = exact_dot(xs, ws, acc, INTERPRETED)
    dtype = out_ptr.dtype.element_ty
    # round_to on the bits under the interpreter, whose bf16 cast truncates; compiled, the cast rounds to nearest
    tl.store(out_ptr + row.to(tl.int64)[:, None] * out_row_stride + feature[None, :],
             round_to(acc, dtype, INTERPRETED).to(dtype), mask=row_ok[:, None] & feature_ok[None, :])
