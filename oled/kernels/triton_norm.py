"""RMSNorm with its residual add, and QK-norm + partial RoPE + the KV-cache write, one Triton launch each: drop-ins for
the torch code of oled/models/layers.py and oled/models/attention.py (EngineConfig.fused_norm).

- `add_rms_norm(x, residual, weight, eps)`: (weight * rmsnorm(residual + x), residual + x), the pair a decoder layer
  needs between two sublayers; residual None normalises x alone. The torch path is eight launches (the add, the
  fp32 cast, pow, mean, add, rsqrt, mul, the cast back, the weight multiply: some fuse) for each of a layer's two
  norms.
- `qk_norm_rope(q, k, v, ...)`: every head of a chunk in one launch: queries normed and rotated into a [heads,
  tokens, head_dim] tensor (the layout attention reads), keys normed, rotated and written into the KV cache at
  their positions, values copied there. RoPE's cos and sin are read from tables over every position, made once
  (MoEDiffusionLM.use_fused_norm), at each token's position. The torch path is about thirty launches (two norms,
  the slices and concatenations of two RoPEs, two index copies) and ten more a forward for the cos and sin.

Results are the reference's up to the mean of squares, which sums in another order: every bf16 rounding the torch
code makes is made here too (oled/kernels/norm_kernel.py), so outputs agree to the last bit but where that sum's
last bit moves the normalised value across a rounding boundary (tests/test_triton_norm.py counts them).
"""
from __future__ import annotations

import torch

from .triton_support import available, check_device, interpreted

__all__ = ["available", "add_rms_norm", "qk_norm_rope"]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] (one dtype), weight [H] of that dtype -> (normed [T, H], residual + x [T, H]); with
    residual None: (normed x, x)."""
    import triton

    from .norm_kernel import add_rms_norm_kernel as kernel

    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != x.dtype or (residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape)):
        raise TypeError("x, residual and weight must share one dtype and x and residual one shape")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    check_device(kernel, x, weight, *([residual] if residual is not None else []))
    rows, cols = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    if rows:
        block_r = _rows_per_program(rows, interpreted(kernel))
        kernel[(triton.cdiv(rows, block_r),)](
            x, x if residual is None else residual, weight, out, total, rows, cols, x.stride(0),
            0 if residual is None else residual.stride(0), out.stride(0), total.stride(0), float(eps),
            BLOCK_R=block_r, BLOCK=triton.next_power_of_2(cols), HAS_RESIDUAL=residual is not None,
            num_warps=1 if interpreted(kernel) else _warps(cols))
    return out, total


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """q [T, heads * D], k and v [T, kv_heads * D] (views of one QKV output are fine), cos/sin [P, rotary] (tables
    over positions 0 .. P - 1, rope_cos_sin of them), q_weight/k_weight [D] (None: no QK-norm), positions [T] int
    (each below P and below the caches' max_len: the decoding loop checks the context length), k_cache/v_cache
    [kv_heads, max_len, D] -> queries [heads, T, D]; keys and values written into the caches at `positions`."""
    import triton

    from .norm_kernel import qk_norm_rope_kernel as kernel

    kv_heads, _, head_dim = k_cache.shape
    tokens = q.shape[0]
    heads = q.shape[1] // head_dim
    rotary = cos.shape[-1]
    if (q.shape[1] != heads * head_dim or k.shape != (tokens, kv_heads * head_dim) or v.shape != k.shape
            or v_cache.shape != k_cache.shape or cos.dim() != 2 or sin.shape != cos.shape
            or positions.shape != (tokens,) or rotary % 2 or rotary > head_dim):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cos "
                         f"{tuple(cos.shape)}, positions {tuple(positions.shape)}, cache {tuple(k_cache.shape)}")
    has_norm = q_weight is not None
    if has_norm and (q_weight.shape != (head_dim,) or k_weight is None or k_weight.shape != (head_dim,)):
        raise ValueError(f"QK-norm weights must both be [{head_dim}]")
    dtypes = {t.dtype for t in (q, k, v, cos, sin, k_cache, v_cache) + ((q_weight, k_weight) if has_norm else ())}
    if len(dtypes) != 1:
        raise TypeError(f"one dtype for every input and cache, got {sorted(map(str, dtypes))}")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin)) or cos.stride(0) != sin.stride(0):
        raise ValueError("rows must be contiguous along the head dims, cos and sin of one layout")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("the K and V caches must share one layout, contiguous along head_dim")
    check_device(kernel, q, k, v, cos, sin, positions, k_cache, v_cache)
    out = torch.empty(heads, tokens, head_dim, dtype=q.dtype, device=q.device)
    if tokens:
        rows = _rows_per_program(tokens, interpreted(kernel))
        kernel[(triton.cdiv(tokens, rows), heads + 2 * kv_heads)](
            q, k, v, q.stride(0), k.stride(0), v.stride(0), cos, sin, cos.stride(0),
            q_weight if has_norm else q, k_weight if has_norm else q, positions,
            out, k_cache, v_cache, out.stride(0), k_cache.stride(0), k_cache.stride(1),
            tokens, float(eps), NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, ROTARY=rotary,
            BLOCK_T=rows, BLOCK_D=triton.next_power_of_2(head_dim), HAS_NORM=has_norm, num_warps=1)
    return out


def _rows_per_program(rows: int, interpreting: bool) -> int:
    """Compiled: one row a program, the fastest measured. Interpreted: the cost is per operation, not per element, so
    many rows a program."""
    import triton

    return min(triton.next_power_of_2(rows), 64) if interpreting else 1


def _warps(cols: int) -> int:
    """Compiled: enough warps that each lane holds a few values of the row (2,048 columns: 4 warps, 16 values)."""
    return max(1, min(8, cols // 512))
