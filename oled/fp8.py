"""FP8 routed experts (EngineConfig.expert_dtype="fp8"): the quantisation at load, and the blob layout that the
expert store, the slot pool, the fused MoE kernels, the torch path and the CPU kernel share.

An FP8 blob is bytes (torch.uint8, which is how a kernel tells it from a bf16 blob), one an expert as a bf16 blob:
    gate [I, H] | up [I, H] | down [H, I]      float8_e4m3fn
    gate [I] | up [I] | down [H]               fp32 scales, one an output channel (a row of its matrix)
and a weight is q * its row's scale. Each scale is the smallest power of two that brings its row's largest magnitude
under e4m3's 448, so q * scale is exact in bf16 and in fp32: dequantising loses nothing beyond the quantisation, and
a GEMM may apply the scale to its fp32 sum instead of to every weight (a power of two commutes with rounding) and give
the bits of the same GEMM over the dequantised weights. The fused kernels and the CPU kernel do that.
"""
from __future__ import annotations

import torch

EXPERT_DTYPES = ("bf16", "fp8")          # EngineConfig.expert_dtype
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                          # e4m3's largest finite magnitude
BLOB = torch.uint8                       # an FP8 blob's element type
SCALE = torch.float32


def check_expert_dtype(name: str) -> None:
    if name not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype (--expert-dtype) must be one of {', '.join(EXPERT_DTYPES)}, got {name!r}")


def blob_bytes(hidden: int, inter: int) -> int:
    """Bytes of one FP8 expert blob: the three matrices' e4m3 weights, then their fp32 scales."""
    return 3 * hidden * inter + SCALE.itemsize * (2 * inter + hidden)


def is_fp8_blob(t: torch.Tensor) -> bool:
    return t.dtype == BLOB


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype, any device) -> (q [out, in] float8_e4m3fn, scale [out] fp32) with
    w ~ q * scale[:, None]: each row divided by a power of two (exact) and rounded to e4m3 (to nearest even)."""
    w32 = w.float()
    # amax / 448 = m * 2^e with 0.5 <= m < 1: 2^e is a power of two above it (a zero row gets 2^0)
    _, exponent = torch.frexp(w32.abs().amax(dim=1) / FP8_MAX)
    scale = torch.ldexp(torch.ones_like(w32[:, 0]), exponent)
    return (w32 / scale[:, None]).to(FP8), scale


def dequantise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """q [..., out, in] e4m3, scale [..., out] -> the weights in dtype (bf16 or fp32), into `out` if given. Exact,
    and computed in dtype: e4m3 values and power-of-two scales are exact in bf16, and so is their product."""
    return torch.mul(q.to(dtype), scale.to(dtype).unsqueeze(-1), out=out)


def blob_views(blob: torch.Tensor, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 blob [..., blob_bytes] (or the rows of a pool or a layer's blobs) -> views of its e4m3 weights
    [..., 3 * I * H] and of its fp32 scales [..., 2 * I + H]."""
    n = 3 * hidden * inter
    return blob[..., :n].view(FP8), blob[..., n:].view(SCALE)


def part_views(blob: torch.Tensor, index: int, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of projection `index` (0 gate, 1 up, 2 down) of a 1-D FP8 blob: its e4m3 weights in nn.Linear layout
    ([out, in]) and its scales [out]."""
    q, scales = blob_views(blob, hidden, inter)
    n = hidden * inter
    rows, cols = (hidden, inter) if index == 2 else (inter, hidden)
    return q[index * n:(index + 1) * n].view(rows, cols), scales[index * inter:index * inter + rows]


def dequantise_blobs(blobs: torch.Tensor, hidden: int, inter: int, dtype: torch.dtype) -> torch.Tensor:
    """FP8 blobs [S, blob_bytes] (or one [blob_bytes]) -> the same experts as bf16-layout blobs [S, 3 * I * H] (or
    [3 * I * H]) in dtype, gate | up | down: what the torch path and the references compute with."""
    q, scales = blob_views(blobs, hidden, inter)
    lead, n = q.shape[:-1], 2 * inter * hidden
    out = torch.empty(*lead, 3 * inter * hidden, dtype=dtype, device=blobs.device)
    dequantise(q[..., :n].reshape(*lead, 2 * inter, hidden), scales[..., :2 * inter], dtype,
               out=out[..., :n].view(*lead, 2 * inter, hidden))
    dequantise(q[..., n:].reshape(*lead, hidden, inter), scales[..., 2 * inter:], dtype,
               out=out[..., n:].view(*lead, hidden, inter))
    return out


def quantise_blobs(blobs: torch.Tensor, hidden: int, inter: int) -> torch.Tensor:
    """bf16-layout blobs [S, 3 * I * H] (or one [3 * I * H]; any float dtype) -> FP8 blobs [S, blob_bytes] (or
    [blob_bytes]): whole experts quantised as the store quantises them part by part (tests, benchmarks)."""
    lead = blobs.shape[:-1]
    flat = blobs.reshape(-1, blobs.shape[-1])
    count, split = flat.shape[0], 2 * inter * hidden
    q_gate_up, s_gate_up = quantise(flat[:, :split].reshape(count * 2 * inter, hidden))
    q_down, s_down = quantise(flat[:, split:].reshape(count * hidden, inter))
    out = torch.empty(count, blob_bytes(hidden, inter), dtype=BLOB, device=blobs.device)
    q, scales = blob_views(out, hidden, inter)
    q.copy_(torch.cat([q_gate_up.view(count, -1), q_down.view(count, -1)], dim=1))
    scales.copy_(torch.cat([s_gate_up.view(count, -1), s_down.view(count, -1)], dim=1))
    return out.view(*lead, -1)
