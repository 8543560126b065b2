"""Grouped SwiGLU over cache slots: one fixed sequence of kernels per call, however many experts are active."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import fp8


def grouped_swiglu(x: torch.Tensor, pair_tokens: torch.Tensor, pair_slots: torch.Tensor, pool: torch.Tensor,
                   hidden: int, intermediate: int, slot_base: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute expert(x[token]) for each (token, slot) pair whose slot is >= 0.

    x [T, H]; pair_tokens, pair_slots [P] int64; pool [S, 3*I*H] holds the blobs (gate | up | down) of slots
    slot_base .. slot_base+S-1 (one layer's slots: the grouped GEMM takes at most 1024 groups on CUDA); or FP8
    blobs [S, fp8.blob_bytes], dequantised to x's dtype first (the reference the fused kernels' FP8 path equals).
    Returns (order, y): y[j] is the output of pair order[j] for j < number of valid pairs; rows past that are
    unspecified. Pairs are grouped by slot with a stable sort, so each expert sees its tokens in routing order and
    the result of a pair does not depend on which other experts are active or where its slot is.
    """
    n_slots = pool.shape[0]
    H, I = hidden, intermediate
    key = torch.where(pair_slots >= 0, pair_slots - slot_base, n_slots)
    order = torch.argsort(key, stable=True)
    # scatter_add rather than bincount: bincount on CUDA reads the maximum back to the host (a sync per layer)
    counts = torch.zeros(n_slots + 1, dtype=torch.int64, device=key.device).scatter_add_(
        0, key, torch.ones_like(key))[:n_slots]
    if fp8.is_fp8_blob(pool):
        if pool.device.type == "cpu":
            # only the slots with pairs (a layer of LLaDA2.0-flash's experts is 6 GiB dequantised): empty groups
            # dropped, the others keep their order; on CUDA the whole pool, as no host sync may decide the shape
            active = torch.nonzero(counts).flatten()
            pool, counts = pool.index_select(0, active), counts.index_select(0, active)
            n_slots = len(active)
            if not n_slots:
                return order, x.new_zeros(pair_slots.shape[0], H)
        pool = fp8.dequantise_blobs(pool, H, I, x.dtype)
    offs = counts.cumsum(0).to(torch.int32)
    xs = x.index_select(0, pair_tokens.index_select(0, order))
    gate_up = pool[:, : 2 * I * H].view(n_slots, 2 * I, H)   # gate rows then up rows: one fused [2I, H] matrix
    down = pool[:, 2 * I * H:].view(n_slots, H, I)
    h = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)
    a = F.silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(a, down.transpose(-2, -1), offs=offs)
    return order, y
