"""Greedy x0 and its confidence from LM-head logits without materialising a softmax: a drop-in for
oled.decoding.rules.predict at temperature 0 (rules.with_greedy makes the whole predict of it).

For each row of logits [B, V] fp32: x0 = the argmax (lowest index on ties, like torch.argmax) and its
probability softmax(logits)[x0] = 1 / sum(exp(logit - max)), from one pass over V (online max and sum; the
kernels are in oled/kernels/confidence_kernel.py). The reference writes a [B, V] softmax and reads it back.

Non-finite rows mirror the reference exactly: a row with a NaN or +Inf (or only -Inf) has an all-NaN softmax
there, so x0 = 0 and the probability is NaN; -Inf entries in an otherwise finite row are just zero-probability.

One documented difference: the reference takes the argmax of the rounded probabilities, this takes the argmax of
the logits. They can differ only where two different logits round to the same probability, i.e. both within
about 1e-7 of the row maximum (possible only for a maximum below ~2 in magnitude, where the float spacing is that
fine); the two probabilities are then equal, so the confidence agrees and x0 is an equally valid argmax of the
reference's probabilities.
"""
from __future__ import annotations

import torch

from .triton_support import available, check_device, interpreted, multiprocessors

__all__ = ["available", "greedy_confidence"]

# compiled: 2,048 fp32 a tile over 8 warps, two 16-byte loads per thread per tile
_BLOCK, _NUM_WARPS = 2048, 8
# interpreted: the cost is per operation, so fewer, wider tiles
_BLOCK_INTERPRETED = 4096
# aim for this many programs per SM (8 warps each: a full SM), so that a few rows still keep enough loads in
# flight on every SM; Triton does not software-pipeline these loads, so occupancy is what hides the latency
_PROGRAMS_PER_SM = 8


def greedy_confidence(
    logits: torch.Tensor, *, block: int | None = None, splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 -> (x0 [B] int64, probability of x0 [B] fp32), both on the logits' device.

    `block` (columns a tile, a power of two) and `splits` (programs a row) override the launch plan, for tests
    and tuning. One launch when a row is one program, two (scan, combine) when rows are split.
    """
    import triton

    from .confidence_kernel import combine_kernel, scan_kernel

    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise TypeError(f"logits must be [B, V] fp32, got {tuple(logits.shape)} {logits.dtype}")
    rows, cols = logits.shape
    if cols == 0:
        raise ValueError("argmax of an empty row")
    if cols >= 2**31:
        raise ValueError("column indices are int32 in the kernel")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    check_device(scan_kernel, logits)
    interpreting = interpreted(scan_kernel)
    block = block or (_BLOCK_INTERPRETED if interpreting else _BLOCK)
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")

    x0 = torch.empty(rows, dtype=torch.int64, device=logits.device)
    prob = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return x0, prob
    tiles, splits = _plan(rows, cols, block, splits, logits.device, interpreting)
    num_warps = 1 if interpreting else _NUM_WARPS
    if splits == 1:
        scan_kernel[(rows, 1)](logits, x0, prob, prob, prob, x0, x0, cols, logits.stride(0),
                               TILES=tiles, BLOCK=block, SPLIT=False, num_warps=num_warps)
        return x0, prob
    part_f = torch.empty(2, rows * splits, dtype=torch.float32, device=logits.device)   # max, sum
    part_i = torch.empty(2, rows * splits, dtype=torch.int32, device=logits.device)     # position, bad
    scan_kernel[(rows, splits)](logits, x0, prob, part_f[0], part_f[1], part_i[0], part_i[1],
                                cols, logits.stride(0), TILES=tiles, BLOCK=block, SPLIT=True,
                                num_warps=num_warps)
    combine_kernel[(rows,)](x0, prob, part_f[0], part_f[1], part_i[0], part_i[1], splits,
                            BLOCK_SPLITS=triton.next_power_of_2(splits), num_warps=1)
    return x0, prob


def _plan(rows: int, cols: int, block: int, splits: int | None, device: torch.device,
          interpreting: bool) -> tuple[int, int]:
    """(tiles a program, programs a row): every program scans whole tiles and at least one column."""
    import triton

    tiles = triton.cdiv(cols, block)
    if splits is None:
        if interpreting or device.type != "cuda":
            splits = 1
        else:
            splits = triton.cdiv(_PROGRAMS_PER_SM * multiprocessors(device), rows)
    splits = max(1, min(splits, tiles))
    per_program = triton.cdiv(tiles, splits)
    return per_program, triton.cdiv(tiles, per_program)
