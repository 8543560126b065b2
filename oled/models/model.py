"""The MoE diffusion LM (LLaDA2.0 and LLaDA-MoE share this module tree; the config selects the variants)."""
from __future__ import annotations

import torch
from torch import nn

from .attention import Attention, KeyVisibility
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

    def forward(self, h, residual, cos, sin, k_cache, v_cache, positions, key_len, visible, timer):
        """h: the previous sublayer's output, not yet added to the residual stream `residual` (None before the
        first layer: h is the embedding). Returns this layer's MLP output and the stream before it, so that each
        residual add is fused with the norm after it."""
        with timer("attention"):
            x, residual = self.attn_norm.add_norm(h, residual)
            h = self.attn(x, cos, sin, k_cache, v_cache, positions, key_len, visible)
        with timer("moe" if isinstance(self.mlp, MoEBlock) else "dense_mlp"):
            x, residual = self.mlp_norm.add_norm(h, residual)
            h = self.mlp(x)
        return h, residual


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
        self.rope_tables = None         # (cos, sin) over every position, with the fused norms (use_fused_norm)
        self.fused_attention = False    # attention as one Triton kernel, no mask built (use_fused_attention)

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def use_fused_mlp(self) -> None:
        """Every SwiGLU MLP (the dense layers, the shared experts) with gate and up in one GEMM and SiLU * up in one
        Triton launch (layers.SwiGLU.use_fused)."""
        for module in self.modules():
            if isinstance(module, SwiGLU):
                module.use_fused()

    def use_fused_norm(self, on: bool) -> None:
        """Every RMSNorm with its residual add, and every attention prologue (QK-norm, RoPE, the cache write), as
        Triton kernels (oled/kernels/triton_norm.py) or as the torch code. The kernels read RoPE's cos and sin from
        tables over every position, made here once with the weights' dtype and device (the per-forward values,
        element for element)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention)):
                module.fused = on
        self.rope_tables = None
        if on:
            c, w = self.config, self.embed.weight
            self.rope_tables = rope_cos_sin(torch.arange(c.max_position_embeddings, device=w.device), c.rotary_dim,
                                            c.rope_theta, w.dtype)

    def use_fused_attention(self, on: bool) -> None:
        """Every layer's attention over the KV cache as one Triton launch that computes which keys each query sees
        (oled/kernels/triton_attention.py), or as the mask and torch's scaled_dot_product_attention."""
        self.fused_attention = on
        for module in self.modules():
            if isinstance(module, Attention):
                module.fused_attention = on

    def use_fused_linear(self, on: bool) -> None:
        """The attention's QKV and output GEMMs and every SwiGLU's (the dense layers, the shared experts) of up to
        triton_linear.MAX_ROWS rows as the skinny Triton GEMM (oled/kernels/triton_linear.py), or all as F.linear.
        Not the LM head (cuBLAS reads its 157k-row weight at bandwidth) nor the router (its own kernel)."""
        for module in self.modules():
            if isinstance(module, (Attention, SwiGLU)):
                module.fused_linear = on

    def attention_mask(self, positions: torch.Tensor, kv_end: torch.Tensor, key_len: int,
                       block_length: int) -> torch.Tensor:
        """Additive mask over keys [0, key_len) in the model dtype (0: visible, -inf: hidden): key j is visible to
        the query at position p iff j < kv_end and, for block-causal models, block(j) <= block(p) in blocks of the
        request's `block_length` (the official generate() builds its mask from the block length it decodes with).
        Built on the device from device tensors, so it is part of a replayed graph rather than baked into it (only
        the block length is a constant of the graph). Additive rather than boolean because attention would turn a
        boolean mask into this one in every layer (three launches each); the values are the same."""
        keys = torch.arange(key_len, device=positions.device)
        mask = (keys < kv_end)[None, :]
        if self.config.block_causal:
            mask = mask & block_causal_mask(positions, keys, block_length)
        return torch.zeros((), dtype=self.embed.weight.dtype, device=mask.device).where(mask, float("-inf"))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: int, kv_cache, kv_end: int | None = None,
                logits_rows: slice | None = None, timer=NO_TIMER, block_length: int | None = None
                ) -> torch.Tensor | None:
        """Run tokens at positions [start, start+T) against the cache (keys [0, kv_end)); returns fp32 logits of the
        chunk's rows `logits_rows` (None when logits_rows is None: the forward only fills the cache). block_length:
        the blocks of the block-causal mask (None: the config's)."""
        T, device = input_ids.shape[0], input_ids.device
        kv_end = start + T if kv_end is None else kv_end
        positions = torch.arange(start, start + T, device=device)
        return self.run(input_ids, positions, torch.full((), kv_end, device=device), kv_cache,
                        kv_cache.key_len(kv_end), logits_rows, timer, block_length)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_end: torch.Tensor, kv_cache, key_len: int,
            logits_rows: slice | None = None, timer=NO_TIMER, block_length: int | None = None
            ) -> torch.Tensor | None:
        """`forward` with the chunk's positions [T] and key end (0-d) as device tensors: the same kernels on the same
        shapes wherever the chunk sits, so one CUDA graph serves every chunk of a (length, key length, rows)."""
        if self.rope_tables is not None:        # the prologue kernel reads the rows of its positions
            cos, sin = self.rope_tables
        else:
            cos, sin = rope_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta, self.embed.weight.dtype)
        block_length = block_length or self.config.block_length
        mask = None if self.fused_attention else self.attention_mask(positions, kv_end, key_len, block_length)
        visible = KeyVisibility(mask, kv_end, block_length if self.config.block_causal else None)
        h, residual = self.embed(input_ids), None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos, sin, kv_cache.k[i], kv_cache.v[i], positions, key_len, visible,
                                timer)
        if logits_rows is None:
            return None
        with timer("lm_head"):
            x, _ = self.norm.add_norm(h[logits_rows], residual[logits_rows])
            return self.lm_head(x).float()
