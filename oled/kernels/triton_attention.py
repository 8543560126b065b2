"""A chunk's attention over the KV cache in one Triton launch: a drop-in for the additive mask
(MoEDiffusionLM.attention_mask) and F.scaled_dot_product_attention of oled/models/attention.py, with the output's
transpose and reshape for o_proj (EngineConfig.fused_attention).

- `attention(q, k_cache, v_cache, key_len, positions, kv_end, block_length)`: the queries [heads, T, D] that the
  prologue writes (or the torch prologue's transposed view) against cache[:key_len], GQA's query heads of one KV
  head in one program, written straight as [T, heads * D]. Which key each query sees is computed in the kernel from
  the chunk's positions and kv_end (device tensors, so a CUDA graph replays it with new values) and the block
  length: no mask tensor. The torch path is the mask (about eight launches a forward), the SDPA and the copy of
  the transpose.
- The key loop stops at the last key a program's rows see, read at run time, so a graph captured for a large
  key-length bucket does not pay for the padding past kv_end (SDPA attends over every key of the bucket, masked).
- A decode chunk is 32 programs (LLaDA2.0-mini), each walking its keys one dependent tile after another, so its
  keys are split over several programs (auto_splits: enough to fill the multiprocessors once) whose fp32 sums a
  second launch merges in split order (flash-decoding); a prefill has programs enough and runs unsplit.

Results are SDPA's up to the fp32 sums' order (keys in tiles, an online softmax) and, in bf16, where the
probabilities are rounded to bf16 before the second product (as flash attention does): in fp32 they agree to about
1e-6 (tests/test_triton_attention.py). One difference by design: a query that sees no key (which this engine never
makes: each query sees its own key) gets zeros, where SDPA gives NaN.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .triton_support import available, check_device, interpreted, multiprocessors

__all__ = ["AttentionTiles", "available", "attention", "auto_splits"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_len: int, positions: torch.Tensor,
              kv_end: torch.Tensor, block_length: int | None, tiles: "AttentionTiles | None" = None) -> torch.Tensor:
    """q [heads, T, D] (any strides, contiguous along D), k_cache/v_cache [kv_heads, max_len, D] (one layout,
    contiguous along D; heads a multiple of kv_heads), key_len <= max_len, positions [T] int (the queries'),
    kv_end 0-d int, block_length (None: not block-causal) -> [T, heads * D] in q's dtype:
    softmax(q k^T / sqrt(D)) v per query head h over the keys of KV head h // (heads // kv_heads) that it sees,
    key < min(key_len, kv_end) and, block-causal, key // block_length <= position // block_length. tiles: the
    program's rows and key tile (None: default_tiles; benchmarks/kernels_bench.py --attention-tiles measures
    others)."""
    import triton

    from .attention_kernel import attention_kernel as kernel
    from .attention_kernel import combine_splits_kernel

    if (q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape or q.shape[2] != k_cache.shape[2]
            or q.shape[0] % k_cache.shape[0] or positions.shape != (q.shape[1],) or kv_end.dim() != 0):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)} (want [heads, T, D]), caches {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)} (want [kv_heads, max_len, D], heads a multiple of kv_heads), "
                         f"positions {tuple(positions.shape)} (want [T]), kv_end {tuple(kv_end.shape)} (want 0-d)")
    if not 0 <= key_len <= k_cache.shape[1] or (block_length is not None and block_length < 1):
        raise ValueError(f"key_len {key_len} must lie in [0, {k_cache.shape[1]}] and block_length {block_length} be "
                         "None or >= 1")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q and the caches must share one of float32, bfloat16, float16, got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if positions.dtype.is_floating_point or kv_end.dtype.is_floating_point:
        raise TypeError(f"positions and kv_end must be integer tensors, got {positions.dtype} and {kv_end.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("q and the caches must be contiguous along head_dim, the K and V caches of one layout")
    check_device(kernel, q, k_cache, v_cache, positions, kv_end)
    heads, tokens, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    out = torch.empty(tokens, heads * head_dim, dtype=q.dtype, device=q.device)
    if tokens:
        interpreting = interpreted(kernel)
        tiles = tiles or default_tiles(tokens * group, interpreting)
        block_t = _block_t(tiles.rows, tokens, group)
        programs = triton.cdiv(tokens, block_t) * kv_heads
        splits = tiles.splits or auto_splits(programs, key_len, tiles.block_n, q.device, interpreting)
        qk_scale = math.log2(math.e) / math.sqrt(head_dim)            # SDPA's default scale, for exp2
        block_d = max(16, triton.next_power_of_2(head_dim))
        if splits > 1:
            part_acc = torch.empty(splits, heads, tokens, head_dim, dtype=torch.float32, device=q.device)
            part_max, part_sum = (torch.empty(splits, heads, tokens, dtype=torch.float32, device=q.device)
                                  for _ in "ms")
        else:
            part_acc = part_max = part_sum = out        # not read: the kernel writes out itself
        kernel[(triton.cdiv(tokens, block_t), kv_heads, splits)](
            q, k_cache, v_cache, out, part_acc, part_max, part_sum, positions, kv_end, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), out.stride(0), tokens, heads, key_len, block_length or 1, qk_scale,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_G=triton.next_power_of_2(group),
            BLOCK_N=tiles.block_n, BLOCK_D=block_d, BLOCK_CAUSAL=block_length is not None, SPLITS=splits,
            INTERPRETED=interpreting, num_warps=tiles.warps, num_stages=tiles.stages)
        if splits > 1:
            combine_splits_kernel[(tokens,)](
                part_acc, part_max, part_sum, out, tokens, heads, out.stride(0), HEAD_DIM=head_dim,
                BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=block_d, SPLITS=splits, INTERPRETED=interpreting,
                num_warps=4)
    return out


class AttentionTiles(NamedTuple):
    rows: int           # a program's query rows: BLOCK_T tokens of each of the group's heads (at least 16 in all)
    block_n: int        # keys a tile
    warps: int
    stages: int
    splits: int = 0     # programs a row's keys are split over (their sums merged by a second launch); 0: auto_splits


def default_tiles(rows: int, interpreting: bool) -> AttentionTiles:
    """The tiles for a chunk of `rows` query rows a KV head (tokens x group). Compiled: a decode chunk (LLaDA2.0-mini:
    32 tokens x 4 heads) in programs of 16 rows, 8 a KV head and 32 in all, their keys split by auto_splits, in
    tiles of 64; a prefill (2,048 rows a KV head and more) in programs of 128 rows and 8 warps, as Triton's
    flash-attention tutorial has for head_dim 128 (docs/decisions.md: attention-key-splits). Interpreted: the cost
    is per operation, so small tiles are cheap, and 32 rows and 32 keys still split the tests' chunks and key ranges
    into several tiles."""
    if interpreting:
        return AttentionTiles(rows=32, block_n=32, warps=1, stages=1)
    if rows >= 2048:
        return AttentionTiles(rows=128, block_n=64, warps=8, stages=2)
    return AttentionTiles(rows=16, block_n=64, warps=4, stages=2)


MAX_SPLITS = 8


def auto_splits(programs: int, key_len: int, block_n: int, device: torch.device, interpreting: bool) -> int:
    """Key splits for a launch of `programs` (token blocks x KV heads): enough that the programs fill the device's
    multiprocessors once, at most MAX_SPLITS and one a tile of the key_len bucket. The split is fixed when a graph is
    captured, and the keys a forward really walks (to kv_end) are shared out at run time, so a bucket larger than
    kv_end costs only splits with nothing to do. Interpreted: one (the tests ask for splits themselves)."""
    import triton

    if interpreting:
        return 1
    return max(1, min(MAX_SPLITS, multiprocessors(device) // programs, triton.cdiv(key_len, block_n)))


def _block_t(rows: int, tokens: int, group: int) -> int:
    """Tokens a program takes: `rows` over the group's power of two, at most the chunk's, and enough for the 16 rows
    of a tensor-core tile."""
    import triton

    group_rows = triton.next_power_of_2(group)
    block_t = min(max(1, rows // group_rows), triton.next_power_of_2(tokens))
    return max(block_t, triton.cdiv(16, group_rows))
