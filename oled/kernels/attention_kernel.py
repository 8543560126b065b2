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

from .kernel_math import exact_dot, round_to


@triton.jit
def _attend_tile(acc, row_max, row_sum, q, k_head, v_head, start, end, row_end, cache_pos_stride, qk_scale,
                 d, d_ok, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """The online softmax's step over keys [start, start + BLOCK_N): (acc, running max, running sum) updated.
    Keys at or past `end` are not loaded (zeros); a row's keys at or past its row_end score -inf."""
    key = start + tl.arange(0, BLOCK_N)
    loaded = key < end
    k = tl.load(k_head + key[None, :] * cache_pos_stride + d[:, None], mask=loaded[None, :] & d_ok[:, None],
                other=0.0)                                                                  # [BLOCK_D, BLOCK_N]
    scores = exact_dot(q, k, tl.zeros([q.shape[0], BLOCK_N], tl.float32), INTERPRETED) * qk_scale
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
    acc = exact_dot(p, v, acc * rescale[:, None], INTERPRETED)
    return acc, new_max, row_sum


@triton.jit
def attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, positions_ptr, kv_end_ptr,
    q_head_stride, q_token_stride, cache_head_stride, cache_pos_stride, out_stride,
    num_tokens, num_heads, key_len, block_length, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_CAUSAL: tl.constexpr, SPLITS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Grid (token blocks, KV heads, key splits): program (b, g, s) takes tokens b * BLOCK_T .. of query heads
    g * GROUP .. (GROUP of them, BLOCK_G its power of two), row r of its tile being head r // BLOCK_T, token
    r % BLOCK_T, and the s-th of SPLITS equal runs of key tiles up to the last key its rows see.

    q[h, t] (strided), k/v_cache[g, key] -> out[t, h * HEAD_DIM + d]: softmax(q k^T * scale) v over the keys the
    query at positions[t] sees, key < min(key_len, kv_end[()]) and, with BLOCK_CAUSAL, key // block_length <=
    positions[t] // block_length. qk_scale: the softmax scale times log2(e). A row that sees no key gets zeros.
    SPLITS 1 writes out; more write each split's unnormalised sums and its running max and sum (fp32, [split, head,
    token]) to the part_* buffers for combine_splits_kernel: a decode chunk is too few programs to fill the GPU, and
    each walks its keys one dependent tile after another (flash-decoding's split).
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
    if SPLITS > 1:
        # whole tiles per split, so every split but the last starts and ends on a tile boundary
        per_split = tl.cdiv(tl.cdiv(end, BLOCK_N), SPLITS) * BLOCK_N
        first = tl.program_id(2) * per_split
        end = tl.minimum(end, first + per_split)
    else:
        first = 0

    k_head = k_cache_ptr + kv_head.to(tl.int64) * cache_head_stride
    v_head = v_cache_ptr + kv_head.to(tl.int64) * cache_head_stride
    acc = tl.zeros([BLOCK_G * BLOCK_T, BLOCK_D], tl.float32)
    row_max = tl.full([BLOCK_G * BLOCK_T], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_G * BLOCK_T], tl.float32)
    if INTERPRETED:
        start = first
        while start < end:
            acc, row_max, row_sum = _attend_tile(acc, row_max, row_sum, q, k_head, v_head, start, end, row_end,
                                                 cache_pos_stride, qk_scale, d, d_ok, BLOCK_N, INTERPRETED)
            start += BLOCK_N
    else:
        for start in range(first, end, BLOCK_N):
            acc, row_max, row_sum = _attend_tile(acc, row_max, row_sum, q, k_head, v_head, start, end, row_end,
                                                 cache_pos_stride, qk_scale, d, d_ok, BLOCK_N, INTERPRETED)
    if SPLITS > 1:
        part = (tl.program_id(2) * num_heads + head.to(tl.int64)) * num_tokens + token          # [split, head, token]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=here)
        tl.store(part_max_ptr + part, row_max, mask=row_ok)
        tl.store(part_sum_ptr + part, row_sum, mask=row_ok)
    else:
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]        # no key seen: acc is 0, so are its outputs
        STORE = out_ptr.dtype.element_ty
        tl.store(out_ptr + token[:, None] * out_stride + head[:, None] * HEAD_DIM + d[None, :],
                 round_to(out, STORE, INTERPRETED).to(STORE), mask=here)


@triton.jit
def combine_splits_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_tokens, num_heads, out_stride,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Grid (tokens,): the key splits of attention_kernel merged for every head of one token, in split order (so
    every call sums alike): out = sum_s acc_s 2^(max_s - max) / sum_s sum_s 2^(max_s - max), max the largest."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    head_ok = head < num_heads
    here = head_ok[:, None] & (d < HEAD_DIM)[None, :]
    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        top = tl.maximum(top, tl.load(part_max_ptr + (s * num_heads + head) * num_tokens + token, mask=head_ok,
                                      other=float("-inf")))
    base = tl.where(top == float("-inf"), 0.0, top)     # a row that saw no key: every split's weight is 0
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    for s in tl.static_range(SPLITS):
        part = (s * num_heads + head) * num_tokens + token
        weight = tl.exp2(tl.load(part_max_ptr + part, mask=head_ok, other=float("-inf")) - base)
        total += tl.load(part_sum_ptr + part, mask=head_ok, other=0.0) * weight
        acc += tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=here, other=0.0) * weight[:, None]
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    STORE = out_ptr.dtype.element_ty
    tl.store(out_ptr + token * out_stride + head[:, None] * HEAD_DIM + d[None, :],
             round_to(out, STORE, INTERPRETED).to(STORE), mask=here)
