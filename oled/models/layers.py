"""Building blocks shared by the model implementations (and the tiny-model trainer)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
            from ..kernels.triton_norm import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        total = x if residual is None else residual + x
        return self(total), total


def linear(x: torch.Tensor, weight: torch.Tensor, skinny: bool) -> torch.Tensor:
    """x @ weight^T, no bias. With `skinny` (EngineConfig.fused_linear) a 2-D x of up to triton_linear.MAX_ROWS rows
    (a decode step) takes the skinny Triton GEMM, which reads the weight once; more rows (a prefill, where cuBLAS's
    large tiles win) and `skinny` off take F.linear, what nn.Linear runs."""
    if skinny:
        from ..kernels.triton_linear import MAX_ROWS
        from ..kernels.triton_linear import linear as skinny_linear

        if x.dim() == 2 and x.shape[0] <= MAX_ROWS:
            return skinny_linear(x, weight)
    return F.linear(x, weight)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: the dense MLP, the shared expert, and (as a reference) one expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up = None         # [gate; up] stacked, with the fused kernel (use_fused)
        self.fused_linear = False   # its GEMMs of a decode step as the skinny Triton GEMM (set by the model)

    def use_fused(self) -> None:
        """Compute gate and up as one GEMM and SiLU * up as one Triton launch (oled/kernels/triton_mlp.py). The
        stacked weight is made once; gate_proj and up_proj become views of it, so no weight is held twice."""
        if self.gate_up is None:
            with torch.no_grad():
                stacked = torch.cat([self.gate_proj.weight, self.up_proj.weight])
            inter = self.gate_proj.weight.shape[0]
            self.gate_proj.weight = nn.Parameter(stacked[:inter], requires_grad=False)
            self.up_proj.weight = nn.Parameter(stacked[inter:], requires_grad=False)
            self.gate_up = stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skinny = self.fused_linear
        if self.gate_up is not None:
            from ..kernels.triton_mlp import silu_mul

            act = silu_mul(linear(x, self.gate_up, skinny))
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
