"""Self-attention with QK-norm, partial rotate-half RoPE, GQA, and a KV cache written in place."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import RMSNorm, apply_rope


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

    def forward(self, x, cos, sin, k_cache, v_cache, start: int, kv_end: int, mask):
        """x [T, H] for positions start..start+T; k_cache/v_cache [kv_heads, max_len, head_dim] of this layer.

        Writes this chunk's K/V at [start, start+T) and attends over cache[:kv_end] (which must include them).
        mask: None (every key visible) or a boolean [T, kv_end] mask.
        """
        T = x.shape[0]
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache[:, start:start + T] = k.transpose(0, 1)
        v_cache[:, start:start + T] = v.transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k_cache[:, :kv_end].unsqueeze(0), v_cache[:, :kv_end].unsqueeze(0),
            attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.squeeze(0).transpose(0, 1).reshape(T, self.q_dim))
