"""The MoE diffusion LM (LLaDA2.0 and LLaDA-MoE share this module tree; the config selects the variants)."""
from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .config import ModelConfig
from .layers import RMSNorm, SwiGLU, block_causal_mask, rope_cos_sin
from .moe import MoEBlock


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (SwiGLU(config.hidden_size, config.dense_intermediate_size)
                    if layer_idx < config.num_dense_layers else MoEBlock(config, layer_idx))

    def forward(self, h, cos, sin, k_cache, v_cache, start, kv_end, mask, timer):
        with timer("attention"):
            h = h + self.attn(self.attn_norm(h), cos, sin, k_cache, v_cache, start, kv_end, mask)
        with timer("moe" if isinstance(self.mlp, MoEBlock) else "dense_mlp"):
            h = h + self.mlp(self.mlp_norm(h))
        return h


class _NoTimer:
    def __call__(self, name):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


NO_TIMER = _NoTimer()


class MoEDiffusionLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def attention_mask(self, start: int, length: int, kv_end: int, device) -> torch.Tensor | None:
        """None when every key in [0, kv_end) is visible to every query (no mask: fastest attention kernels)."""
        if not self.config.block_causal:
            return None
        block = self.config.block_length
        if (kv_end - 1) // block <= start // block:
            return None
        q_pos = torch.arange(start, start + length, device=device)
        return block_causal_mask(q_pos, torch.arange(kv_end, device=device), block)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: int, kv_cache, kv_end: int | None = None,
                logits_rows: slice | None = None, timer=NO_TIMER) -> torch.Tensor | None:
        """Run tokens at positions [start, start+T) against the cache (keys [0, kv_end)); returns fp32 logits of the
        chunk's rows `logits_rows` (None when logits_rows is None: the forward only fills the cache)."""
        T = input_ids.shape[0]
        kv_end = start + T if kv_end is None else kv_end
        positions = torch.arange(start, start + T, device=input_ids.device)
        cos, sin = rope_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta, self.embed.weight.dtype)
        mask = self.attention_mask(start, T, kv_end, input_ids.device)
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache.k[i], kv_cache.v[i], start, kv_end, mask, timer)
        if logits_rows is None:
            return None
        with timer("lm_head"):
            return self.lm_head(self.norm(h[logits_rows])).float()
