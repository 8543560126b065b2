"""Triton kernel: a chunk's attention over the KV cache, every query head of one KV head in one program.

Imports Triton unconditionally; only oled.kernels.triton_attention imports this module, and only when Triton is
available. The launcher and the semantics are documented there.

Flash attention: a program owns BLOCK_T tokens of the GROUP query heads that read one KV head (GQA), packed as the
BLOCK_G * BLOCK_T rows of one tile, so each K and V tile is loaded once for the whole group. It walks the keys in
BLOCK_N tiles with an online softmax in fp32 (base 2: the scale carries log2(e)), and stops at the last key any of
its rows sees, read at run time: min(key_len, kv_end) and, block-causal, the end of its last row's block. A graph
captured for a large key-length bucket so pays only for the keys up to kv_end.
The key loop is a `for` compiled (software-pipelined) and a `while` interpreted: Triton 3.6's interpreter cannot run
a `for` over a runtime range under NumPy >= 2.4 (triton-lang/triton#9171).
"""
import triton
import triton.language as tl

from .kernel_math import round_to


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr):
    """acc + a @ b with fp32 accumulation, fp32 inputs as exact FMAs (never TF32). The interpreter's dot multiplies
    bf16 as raw uint16, so there the operands are widened first (exact), as in moe_kernel._dot."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _attend_tile(acc, row_max, row_sum, q, k_head, v_head, start, end, row_end, cache_pos_stride, qk_scale,
                 d, d_ok, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """The online softmax's step over keys [start, start + BLOCK_N): (acc, running max, running sum) updated.
    Keys at or past `end` are not loaded (zeros); a row's keys at or past its row_end score -inf."""
    key = start + tl.arange(0, BLOCK_N)
    loaded = key < end
    k = tl.load(k_head + key[None, :] * cache_pos_stride + d[:, None], mask=loaded[None, :] & d_ok[:, None],
                other=0.0)                                                                  # [BLOCK_D, BLOCK_N]
    scores = _dot(q, k, tl.zeros([q.shape[0], BLOCK_N], tl.float32), INTERPRETED) * qk_scale
    scores = tl.where(key[None, :] < row_end[:, None], scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    # a row that has seen no key yet keeps max -inf: subtract 0 there, so exp2 gives 0 rather than NaN
    base = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp2(row_max - base)
    p = tl.exp2(scores - base[:, None])
    row_sum = row_sum * rescale + tl.sum(p, axis=1)
    v = tl.load(v_head + key[:, None] * cache_pos_stride + d[None, :], mask=loaded[:, None] & d_ok[None, :],
                other=0.0)                                                                  # [BLOCK_N, BLOCK_D]
    # P in the inputs' dtype for the second product, as flash attention (and SDPA's bf16 paths) do
    p = round_to(p, v.dtype, INTERPRETED).to(v.dtype)
    acc = _dot(p, v, acc * rescale[:, None], INTERPRETED)
    return acc, new_max, row_sum


@triton.jit
def attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, positions_ptr, kv_end_ptr,
    q_head_stride, q_token_stride, cache_head_stride, cache_pos_stride, out_stride,
    num_tokens, key_len, block_length, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_CAUSAL: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Grid (token blocks, KV heads): program (b, g) takes tokens b * BLOCK_T .. of query heads g * GROUP ..
    (GROUP of them, BLOCK_G its power of two), row r of its tile being head r // BLOCK_T, token r % BLOCK_T.

    q[h, t] (strided), k/v_cache[g, key] -> out[t, h * HEAD_DIM + d]: softmax(q k^T * scale) v over the keys the
    query at positions[t] sees, key < min(key_len, kv_end[()]) and, with BLOCK_CAUSAL, key // block_length <=
    positions[t] // block_length. qk_scale: the softmax scale times log2(e). A row that sees no key gets zeros.
    """
    kv_head = tl.program_id(1)
    row = tl.arange(0, BLOCK_G * BLOCK_T)
    head = kv_head * GROUP + row // BLOCK_T
    token = tl.program_id(0) * BLOCK_T + row % BLOCK_T
    row_ok = (row // BLOCK_T < GROUP) & (token < num_tokens)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    here = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + head.to(tl.int64)[:, None] * q_head_stride + token[:, None] * q_token_stride + d[None, :],
                mask=here, other=0.0)

    # each row sees keys [0, row_end); the tile's loop ends at the furthest of them
    visible = tl.minimum(tl.load(kv_end_ptr), key_len).to(tl.int32)
    row_end = tl.zeros([BLOCK_G * BLOCK_T], tl.int32) + visible
    if BLOCK_CAUSAL:
        pos = tl.load(positions_ptr + token, mask=row_ok, other=0).to(tl.int32)
        row_end = tl.minimum(row_end, (pos // block_length + 1) * block_length)
    row_end = tl.where(row_ok, row_end, 0)
    end = tl.max(row_end, axis=0)

    k_head = k_cache_ptr + kv_head.to(tl.int64) * cache_head_stride
    v_head = v_cache_ptr + kv_head.to(tl.int64) * cache_head_stride
    acc = tl.zeros([BLOCK_G * BLOCK_T, BLOCK_D], tl.float32)
    row_max = tl.full([BLOCK_G * BLOCK_T], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_G * BLOCK_T], tl.float32)
    if INTERPRETED:
        start = 0
        while start < end:
            acc, row_max, row_sum = _attend_tile(acc, row_max, row_sum, q, k_head, v_head, start, end, row_end,
                                                 cache_pos_stride, qk_scale, d, d_ok, BLOCK_N, INTERPRETED)
            start += BLOCK_N
    else:
        for start in range(0, end, BLOCK_N):
            acc, row_max, row_sum = _attend_tile(acc, row_max, row_sum, q, k_head, v_head, start, end, row_end,
                                                 cache_pos_stride, qk_scale, d, d_ok, BLOCK_N, INTERPRETED)
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]        # no key seen: acc is 0, so are its outputs
    STORE = out_ptr.dtype.element_ty
    tl.store(out_ptr + token[:, None] * out_stride + head[:, None] * HEAD_DIM + d[None, :],
             round_to(out, STORE, INTERPRETED).to(STORE), mask=here)
