"""Triton kernels: RMSNorm with the residual add before it, and QK-norm + partial RoPE + the KV-cache write.

Imports Triton unconditionally; only oled.kernels.triton_norm imports this module, and only when Triton is
available. The launchers and the semantics are documented there.

Every rounding of the torch reference is reproduced (oled/models/layers.py): its bf16 operations compute in fp32 and
round once, so each product or sum here is formed in fp32 and cast to the storage dtype where the reference casts.
Only the mean of squares sums in another order. bf16 is rounded on the bits, compiled and interpreted
(kernel_math.round_to says why).
"""
import triton
import triton.language as tl

from .kernel_math import round_to


@triton.jit
def _normed(x, w, n_cols, eps, STORE: tl.constexpr):
    """weight * (x / rms(x)).to(dtype) per row of x [rows, cols], the reference's two roundings: x fp32 (already in
    the storage precision), w the weight as loaded; STORE the storage dtype."""
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)[:, None]
    return round_to(w.to(tl.float32) * round_to(x * inv, STORE, True), STORE, True).to(STORE)


@triton.jit
def add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    num_rows, n_cols, x_stride, residual_stride, out_stride, sum_stride, eps,
    BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """BLOCK_R rows a program: sum = residual + x (rounded to x's dtype, as torch's add) when HAS_RESIDUAL, then
    out = weight * rmsnorm(sum) (or of x alone)."""
    row = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    col = tl.arange(0, BLOCK)[None, :]
    here = (row < num_rows) & (col < n_cols)
    x = tl.load(x_ptr + row * x_stride + col, mask=here, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + col, mask=here, other=0.0)
        x = round_to(r.to(tl.float32) + x.to(tl.float32), sum_ptr.dtype.element_ty, True)
        tl.store(sum_ptr + row * sum_stride + col, x.to(sum_ptr.dtype.element_ty), mask=here)
    w = tl.load(weight_ptr + col, mask=col < n_cols, other=0.0)
    y = _normed(x.to(tl.float32), w, n_cols, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + col, y, mask=here)


@triton.jit
def qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride,
    cos_ptr, sin_ptr, rope_stride, q_weight_ptr, k_weight_ptr, positions_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr, q_out_head_stride, cache_head_stride, cache_pos_stride,
    num_tokens, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """Grid (token blocks, NUM_HEADS + 2 * NUM_KV_HEADS): program (b, h) takes head h of BLOCK_T tokens.

    Query heads: QK-norm, rotate-half RoPE on the first ROTARY dims (cos and sin: rows positions[t] of the
    tables), written to q_out[h, t]. Key heads: the same, written to k_cache[h, positions[t]]. Value heads: copied
    to v_cache[h, positions[t]]. RoPE's partner of dim d < ROTARY is d + ROTARY/2 (negated) below the half and
    d - ROTARY/2 above it; the partner is normed again from its own input rather than exchanged between lanes.
    """
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]      # [BLOCK_T, 1]
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)[None, :]                                                   # [1, BLOCK_D]
    token_ok = t < num_tokens
    here = token_ok & (d < HEAD_DIM)
    pos = tl.load(positions_ptr + t, mask=token_ok, other=0).to(tl.int64)
    if h < NUM_HEADS + NUM_KV_HEADS:
        is_q = h < NUM_HEADS
        head = tl.where(is_q, h, h - NUM_HEADS).to(tl.int64)
        if is_q:
            src = q_ptr + t * q_stride + head * HEAD_DIM
            w_ptr = q_weight_ptr
        else:
            src = k_ptr + t * k_stride + head * HEAD_DIM
            w_ptr = k_weight_ptr
        STORE = q_out_ptr.dtype.element_ty
        x = tl.load(src + d, mask=here, other=0.0).to(tl.float32)
        half = ROTARY // 2
        rotated = d < ROTARY
        partner = tl.where(d < half, d + half, d - half)
        xp = tl.load(src + partner, mask=token_ok & rotated, other=0.0).to(tl.float32)
        if HAS_NORM:
            inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
            w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
            x = round_to(w * round_to(x * inv, STORE, True), STORE, True)
            xp = round_to(wp * round_to(xp * inv, STORE, True), STORE, True)
        cos = tl.load(cos_ptr + pos * rope_stride + d, mask=token_ok & rotated, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * rope_stride + d, mask=token_ok & rotated, other=0.0).to(tl.float32)
        xp = tl.where(d < half, -xp, xp)
        roped = round_to(round_to(x * cos, STORE, True) + round_to(xp * sin, STORE, True), STORE, True).to(STORE)
        y = tl.where(rotated, roped, x.to(STORE))
        if is_q:
            tl.store(q_out_ptr + head * q_out_head_stride + t * HEAD_DIM + d, y, mask=here)
        else:
            tl.store(k_cache_ptr + head * cache_head_stride + pos * cache_pos_stride + d, y, mask=here)
    else:
        head = (h - NUM_HEADS - NUM_KV_HEADS).to(tl.int64)
        v = tl.load(v_ptr + t * v_stride + head * HEAD_DIM + d, mask=here, other=0.0)
        tl.store(v_cache_ptr + head * cache_head_stride + pos * cache_pos_stride + d, v, mask=here)
