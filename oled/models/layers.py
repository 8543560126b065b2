"""Building blocks shared by the model implementations (and the tiny-model trainer)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import triton_linear, triton_mlp, triton_norm    # as modules: tests count calls through them


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back to the input dtype before the weight multiply (as the official code)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False      # add_norm as one Triton launch (EngineConfig.fused_norm, set by the model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a sublayer's output x added to the residual stream, and the next
        sublayer's input; residual None starts the stream at x."""
        if self.fused:
            return triton_norm.add_rms_norm(x, residual, self.weight, self.eps)
        total = x if residual is None else residual + x
        return self(total), total


def linear(x: torch.Tensor, weight: torch.Tensor, skinny: bool) -> torch.Tensor:
    """x @ weight^T, no bias. With `skinny` (EngineConfig.fused_linear) a 2-D x of up to triton_linear.MAX_ROWS rows
    (a decode step) takes the skinny Triton GEMM, which reads the weight once; more rows (a prefill, where cuBLAS's
    large tiles win) and `skinny` off take F.linear, what nn.Linear runs."""
    if skinny:
        if x.dim() == 2 and x.shape[0] <= triton_linear.MAX_ROWS:
            return triton_linear.linear(x, weight)
    return F.linear(x, weight)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: the dense MLP, the shared expert, and (as a reference) one expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up = None         # [gate; up] stacked, with the fused kernel (use_fused)
        self.blob = None            # gate | up | down as one contiguous blob (expert_blob)
        self.fused_linear = False   # its GEMMs of a decode step as the skinny Triton GEMM (set by the model)

    def expert_blob(self) -> torch.Tensor:
        """The weights as one contiguous blob, gate [I, H] | up [I, H] | down [H, I]: a routed expert's layout in the
        store and the slot pool, so the fused MoE kernels can compute this MLP as one more expert (the shared
        expert, ExpertManager). Made once; the three weights become views of it, so no weight is held twice."""
        if self.blob is None:
            weights = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
            with torch.no_grad():
                blob = torch.cat([w.reshape(-1) for w in weights])
            views = blob.split([w.numel() for w in weights])
            for proj, w, view in zip((self.gate_proj, self.up_proj, self.down_proj), weights, views):
                proj.weight = nn.Parameter(view.view_as(w), requires_grad=False)
            self.blob = blob
        return self.blob

    def use_fused(self) -> None:
        """Compute gate and up as one GEMM and SiLU * up as one Triton launch (oled/kernels/triton_mlp.py). The
        stacked weight is a view of the blob (expert_blob), so no weight is held twice."""
        if self.gate_up is None:
            inter, hidden = self.gate_proj.weight.shape
            self.gate_up = self.expert_blob()[: 2 * inter * hidden].view(2 * inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skinny = self.fused_linear
        if self.gate_up is not None:
            act = triton_mlp.silu_mul(linear(x, self.gate_up, skinny))
        else:
            act = F.silu(linear(x, self.gate_proj.weight, skinny)) * linear(x, self.up_proj.weight, skinny)
        return linear(act, self.down_proj.weight, skinny)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [T, rotary_dim] for rotate-half RoPE at absolute positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32)
                               / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] dims of each head; the rest pass through. x [T, heads, head_dim]."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def block_causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, block_length: int) -> torch.Tensor:
    """Boolean [Tq, Tk] mask: query i may attend key j iff block(j) <= block(i)."""
    return (k_pos[None, :] // block_length) <= (q_pos[:, None] // block_length)
