"""Self-attention with QK-norm, partial rotate-half RoPE, GQA, and a KV cache written in place."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import triton_attention, triton_norm    # as modules: tests count calls through them
from .config import ModelConfig
from .layers import RMSNorm, apply_rope, linear


class KeyVisibility(NamedTuple):
    """Which cached keys each query of a chunk sees, the same for every layer: key j by the query at position p iff
    j < kv_end and, block-causal, j // block_length <= p // block_length. The torch path reads it as the additive
    `mask` (MoEDiffusionLM.attention_mask); the fused kernel computes it from kv_end and block_length (mask None)."""
    mask: torch.Tensor | None       # [T, key_len] or [1, key_len], 0 or -inf
    kv_end: torch.Tensor            # 0-d, on the device
    block_length: int | None        # None: not block-causal


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_dim, self.kv_dim = q_dim, kv_dim
        if c.fused_qkv:
            self.qkv = nn.Linear(c.hidden_size, q_dim + 2 * kv_dim, bias=False)  # rows: Q heads, K heads, V heads
        else:
            self.q_proj = nn.Linear(c.hidden_size, q_dim, bias=False)
            self.k_proj = nn.Linear(c.hidden_size, kv_dim, bias=False)
            self.v_proj = nn.Linear(c.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.fused = False      # the prologue (QK-norm, RoPE, cache write) as one Triton launch (set by the model)
        self.fused_attention = False    # softmax(QK^T)V over the cache as one Triton launch (set by the model)
        self.fused_linear = False       # the QKV and output GEMMs of a decode step as the skinny Triton GEMM (set
                                        # by the model)

    def forward(self, x, cos, sin, k_cache, v_cache, positions, key_len: int, visible: KeyVisibility):
        """x [T, H] at `positions` (a device tensor [T]); cos/sin: the chunk's RoPE rows [T, rotary] (torch path)
        or the tables over every position (fused, self.fused); k_cache/v_cache [kv_heads, max_len, head_dim] of this
        layer.

        Writes this chunk's K/V at its positions and attends over the keys of cache[:key_len] that `visible` shows
        it, which hides the padding past the chunk's last visible key: nothing here depends on where the chunk
        sits, so a CUDA graph of it serves every chunk of the same shape.
        """
        T, skinny = x.shape[0], self.fused_linear
        if hasattr(self, "qkv"):
            q, k, v = linear(x, self.qkv.weight, skinny).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        else:
            q, k, v = (linear(x, proj.weight, skinny) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.fused:
            norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            q = triton_norm.qk_norm_rope(q, k, v, cos, sin, *norms, eps, positions, k_cache, v_cache)  # [heads, T, D]
        else:
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
            v = v.view(T, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k_cache.index_copy_(1, positions, k.transpose(0, 1))
            v_cache.index_copy_(1, positions, v.transpose(0, 1))
            q = q.transpose(0, 1)
        if self.fused_attention:
            out = triton_attention.attention(q, k_cache, v_cache, key_len, positions, visible.kv_end,
                                             visible.block_length)
        else:
            out = F.scaled_dot_product_attention(
                q.unsqueeze(0), k_cache[:, :key_len].unsqueeze(0), v_cache[:, :key_len].unsqueeze(0),
                attn_mask=visible.mask, enable_gqa=self.num_heads != self.num_kv_heads)
            out = out.squeeze(0).transpose(0, 1).reshape(T, self.q_dim)
        return linear(out, self.o_proj.weight, skinny)
