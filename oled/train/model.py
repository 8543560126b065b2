"""Training module in the LLaDA2.0 architecture (``model_type: llada2_moe``), scaled down.

The module tree mirrors the official ``LLaDA2MoeModelLM`` so that parameter names map 1:1 onto the published
checkpoint layout (``checkpoint.official_state_dict``); the one difference is that the routed experts of a layer
are stored stacked (``mlp.experts.gate_up`` [E, 2I, H] = gate rows then up rows, ``mlp.experts.down`` [E, H, I])
so that training runs them as grouped matrix products instead of a Python loop over experts.

Math (docs/DESIGN.md, LLaDA2.0), per layer, pre-norm residual:
  h += dense(attn(rope(qk_norm(split(query_key_value(input_layernorm(h)))))))
  h += mlp(post_attention_layernorm(h))
with RMSNorm in fp32 cast back before the weight multiply; fused QKV rows Q heads | K heads | V heads; QK-norm
(RMSNorm over head_dim, every head) before rotate-half RoPE on the first head_dim * partial_rotary_factor dims;
GQA; scale 1/sqrt(head_dim). Layer 0 (``first_k_dense_replace``) has a dense SwiGLU MLP; the others a MoE:
the router is ``oled.models.router.sigmoid_group_route`` run in fp32 (sigmoid scores, expert_bias for selection
only, group-limited top-k, unbiased weights renormalised times routed_scaling_factor), output
``sum_k w_k * expert_k(x) + shared_experts(x)``, the weighted sum in fp32 as the official ``moe_infer`` does.

Expert load balancing is auxiliary-loss free: ``update_expert_bias`` moves each layer's ``expert_bias`` by
``u * sign(mean_load - load)`` after each optimizer step (DeepSeek-V3); the bias gets no gradient.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from oled.models.layers import RMSNorm, SwiGLU, apply_rope, block_causal_mask, rope_cos_sin
from oled.models.router import sigmoid_group_route

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


@dataclass
class TinyConfig:
    """Architecture hyper-parameters; field names are the official config.json keys."""
    vocab_size: int = 6144
    hidden_size: int = 256
    num_hidden_layers: int = 7
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512          # the dense (first) layer's MLP
    moe_intermediate_size: int = 32       # one routed expert, and the shared expert (x num_shared_experts)
    num_experts: int = 64
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    num_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    moe_router_enable_expert_bias: bool = True
    partial_rotary_factor: float = 0.5
    rope_theta: float = 600000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1024
    block_length: int = 32
    eos_token_id: int = 0
    pad_token_id: int = 0
    mask_token_id: int = 1
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.num_experts % self.n_group:
            raise ValueError("num_experts must be a multiple of n_group")
        if not (1 <= self.topk_group <= self.n_group):
            raise ValueError("need 1 <= topk_group <= n_group")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError("num_experts_per_tok exceeds the experts of the kept groups")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def to_hf_dict(self) -> dict:
        """config.json contents, with the keys of the published LLaDA2.0-mini config."""
        return {
            "architectures": ["LLaDA2MoeModelLM"],
            "attention_dropout": 0.0,
            "block_length": self.block_length,
            "dtype": "bfloat16",
            "embedding_dropout": 0.0,
            "eos_token_id": self.eos_token_id,
            "first_k_dense_replace": self.first_k_dense_replace,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "mask_token_id": self.mask_token_id,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "llada2_moe",
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_router_enable_expert_bias": self.moe_router_enable_expert_bias,
            "n_group": self.n_group,
            "norm_head": False,
            "norm_softmax": False,
            "norm_topk_prob": self.norm_topk_prob,
            "num_attention_heads": self.num_attention_heads,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_shared_experts": self.num_shared_experts,
            "output_dropout": 0.0,
            "output_router_logits": False,
            "pad_token_id": self.pad_token_id,
            "partial_rotary_factor": self.partial_rotary_factor,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "rotary_dim": self.rotary_dim,
            "routed_scaling_factor": self.routed_scaling_factor,
            "router_dtype": "fp32",
            "score_function": "sigmoid",
            "sliding_window": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "topk_group": self.topk_group,
            "use_bias": False,
            "use_cache": False,
            "use_qkv_bias": False,
            "use_rmsnorm": True,
            "use_sliding_window": False,
            "using_split_qkv_in_self_attention": False,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_hf_dict(cls, raw: dict) -> "TinyConfig":
        if raw.get("model_type") != "llada2_moe":
            raise ValueError(f"not a llada2_moe config: {raw.get('model_type')!r}")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in raw.items() if k in names}
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)


def bd_attention_mask(seq_len: int, block_length: int, device=None) -> torch.Tensor:
    """Boolean [2L, 2L] mask for the block-diffusion input [x_noisy ; x_clean] (True = may attend).

    Noisy block b sees noisy block b and clean blocks < b; clean block b sees clean blocks <= b (block-causal).
    """
    idx = torch.arange(2 * seq_len, device=device)
    clean = idx >= seq_len
    blk = (idx % seq_len) // block_length
    qc, kc = clean[:, None], clean[None, :]
    qb, kb = blk[:, None], blk[None, :]
    noisy_rows = ~qc & ((~kc & (kb == qb)) | (kc & (kb < qb)))
    clean_rows = qc & kc & (kb <= qb)
    return noisy_rows | clean_rows


class Attention(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.query_key_value = nn.Linear(c.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=False)
        self.query_layernorm = RMSNorm(self.hd, c.rms_norm_eps)
        self.key_layernorm = RMSNorm(self.hd, c.rms_norm_eps)
        self.dense = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        qkv = self.query_key_value(x).view(B, T, self.nh + 2 * self.nkv, self.hd)
        q, k, v = qkv.split([self.nh, self.nkv, self.nkv], dim=2)     # rows: Q heads, K heads, V heads
        q, k = self.query_layernorm(q), self.key_layernorm(k)          # QK-norm before RoPE
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)        # [B, T, heads, hd]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.nkv != self.nh:                                        # GQA: q head i uses kv head i // n_rep
            rep = self.nh // self.nkv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = q.to(v.dtype), k.to(v.dtype), v
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.dense(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class Gate(nn.Module):
    """Router parameters under the official names: ``weight`` [E, H] and the fp32 buffer ``expert_bias`` [E]."""

    def __init__(self, c: TinyConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(c.num_experts, dtype=torch.float32))


class GroupedExperts(nn.Module):
    """All routed experts of a layer, stacked: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]."""

    def __init__(self, c: TinyConfig):
        super().__init__()
        E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.num_experts, self.inter = E, I
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down = nn.Parameter(torch.empty(E, H, I))
        self.grouped = HAS_GROUPED_MM

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_sorted [M, H] rows grouped by expert (counts[e] rows for expert e, in expert order) -> [M, H]."""
        dt = x_sorted.dtype
        wgu, wd = self.gate_up.to(dt), self.down.to(dt)
        if self.grouped and (x_sorted.device.type == "cpu" or dt == torch.bfloat16):
            offs = counts.cumsum(0).to(torch.int32)
            gu = torch._grouped_mm(x_sorted, wgu.transpose(-2, -1), offs=offs)
            g, u = gu.split(self.inter, dim=-1)
            return torch._grouped_mm(F.silu(g) * u, wd.transpose(-2, -1), offs=offs)
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                xe = x_sorted[start:start + n]
                g, u = (xe @ wgu[e].t()).split(self.inter, dim=-1)
                outs.append((F.silu(g) * u) @ wd[e].t())
                start += n
        return torch.cat(outs) if outs else x_sorted.new_zeros(0, x_sorted.shape[-1])


class MoE(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.c = c
        self.gate = Gate(c)
        self.experts = GroupedExperts(c)
        self.shared_experts = (SwiGLU(c.hidden_size, c.moe_intermediate_size * c.num_shared_experts)
                               if c.num_shared_experts else None)
        self.last_counts: torch.Tensor | None = None   # tokens per expert of the last forward (no grad)

    def route(self, x: torch.Tensor):
        """(ids [N, k], weights [N, k] fp32), exactly ``sigmoid_group_route`` in fp32 (autocast off)."""
        c = self.c
        with torch.autocast(x.device.type, enabled=False):
            return sigmoid_group_route(
                x, self.gate.weight, self.gate.expert_bias if c.moe_router_enable_expert_bias else None,
                top_k=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
                routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N = x.shape[0]
        ids, w = self.route(x)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.c.num_experts)
        self.last_counts = counts.detach()
        dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        y_sorted = self.experts(x.to(dt).index_select(0, order // k), counts)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        y = y_sorted.index_select(0, inv).view(N, k, -1)               # back to (token, slot) order
        out = (y.float() * w.unsqueeze(-1)).sum(dim=1).to(y.dtype)     # fp32 weighted sum, as moe_infer
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape[:-1] + (out.shape[-1],))


class DecoderLayer(nn.Module):
    def __init__(self, c: TinyConfig, idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attention = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size) if idx < c.first_k_dense_replace else MoE(c)

    def forward(self, h, cos, sin, mask):
        h = h + self.attention(self.input_layernorm(h), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LLaDA2MoeModelLM(nn.Module):
    """``model.*`` + ``lm_head`` (untied), as the official class."""

    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()

    # ---- construction -------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None):
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        out_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("dense.weight", "down_proj.weight", "experts.down")):
                p.copy_(torch.randn(p.shape, generator=g) * out_std)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for m in self.moe_layers():
            m.gate.expert_bias.zero_()

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def cast_params(self, dtype: torch.dtype) -> "LLaDA2MoeModelLM":
        """Cast parameters (not the fp32 expert_bias buffers) to dtype, like the published bf16 checkpoint."""
        for p in self.parameters():
            p.data = p.data.to(dtype)
        return self

    def num_parameters(self) -> dict:
        total = sum(p.numel() for p in self.parameters()) + sum(b.numel() for b in self.buffers())
        c = self.config
        per_expert = 3 * c.hidden_size * c.moe_intermediate_size
        routed = len(self.moe_layers()) * c.num_experts * per_expert
        active = total - routed + len(self.moe_layers()) * c.num_experts_per_tok * per_expert
        return {"total": total, "routed_experts": routed, "active_per_token": active,
                "embedding_and_lm_head": 2 * c.vocab_size * c.hidden_size}

    # ---- forward ------------------------------------------------------------------------------------------
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None):
        """Final-norm hidden states [B, T, H] for input_ids [B, T] at positions [T] under a boolean [T, T] mask."""
        c = self.config
        h = self.model.word_embeddings(input_ids)
        rope_dtype = torch.float32 if torch.is_autocast_enabled(h.device.type) else h.dtype
        cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta, rope_dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, mask)
        return self.model.norm(h)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Inference semantics: logits [B, T, V] (fp32) of a plain sequence under the block-causal mask
        (positions default to 0..T-1; pass mask explicitly to override)."""
        T = input_ids.shape[-1]
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if positions is None:
            positions = torch.arange(T, device=input_ids.device)
        if mask is None:
            mask = block_causal_mask(positions, positions, self.config.block_length)
        return self.lm_head(self.hidden_states(input_ids, positions, mask)).float()

    def bd_hidden(self, x_noisy: torch.Tensor, x_clean: torch.Tensor, mask: torch.Tensor | None = None):
        """Block-diffusion training forward on [x_noisy ; x_clean] ([B, L] each, same positions 0..L-1).
        Returns the hidden states of the noisy half [B, L, H]."""
        B, L = x_noisy.shape
        if mask is None:
            mask = bd_attention_mask(L, self.config.block_length, x_noisy.device)
        pos = torch.arange(L, device=x_noisy.device).repeat(2)
        h = self.hidden_states(torch.cat([x_noisy, x_clean], dim=1), pos, mask)
        return h[:, :L]


@torch.no_grad()
def update_expert_bias(model: LLaDA2MoeModelLM, counts: list[torch.Tensor], rate: float) -> None:
    """Aux-loss-free balancing: expert_bias += rate * sign(mean_load - load) for each MoE layer."""
    for moe, load in zip(model.moe_layers(), counts):
        load = load.float()
        moe.gate.expert_bias.add_(rate * torch.sign(load.mean() - load))
