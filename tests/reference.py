"""A plain reference of the official procedure, written independently of the engine, for equivalence tests.

Reads the checkpoint's safetensors directly, computes in fp32 with explicit loops where the math is subtle
(routing, MoE), recomputes the whole visible sequence every iteration (no KV cache), and decodes with the LLaDA2
rule of docs/DESIGN.md section 4.3.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open


class RefModel:
    def __init__(self, ckpt: Path):
        self.cfg = json.loads((ckpt / "config.json").read_text())
        self.w = {}
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
        for f in sorted(set(index.values())):
            with safe_open(str(ckpt / f), "pt") as st:
                for k in st.keys():
                    self.w[k] = st.get_tensor(k).float()
        c = self.cfg
        self.llada2 = c["model_type"] == "llada2_moe"
        self.H, self.nh, self.nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim") or self.H // self.nh
        self.rot = int(self.hd * c.get("partial_rotary_factor", 1.0))
        self.theta = c["rope_theta"]
        self.eps = c["rms_norm_eps"]
        self.dense = c.get("first_k_dense_replace", 0) if self.llada2 else 0
        self.B = c.get("block_length", 32)

    # ---------------------------------------------------------------- pieces
    def rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x, pos):
        rd = self.rot
        inv = 1.0 / (self.theta ** (torch.arange(0, rd, 2).float() / rd))
        ang = pos.float()[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        r, rest = x[..., :rd], x[..., rd:]
        rh = torch.cat([-r[..., rd // 2:], r[..., : rd // 2]], -1)
        return torch.cat([r * cos[:, None] + rh * sin[:, None], rest], -1)

    def route(self, h, layer):
        """Direct transcription of the routers, one token at a time."""
        c, p = self.cfg, f"model.layers.{layer}.mlp.gate."
        logits = h @ self.w[p + "weight"].t()
        k = c["num_experts_per_tok"]
        out = []
        for t in range(h.shape[0]):
            if self.llada2:
                s = torch.sigmoid(logits[t])
                biased = (s + self.w[p + "expert_bias"]).tolist()
                G, E = c["n_group"], c["num_experts"]
                per = E // G
                gscore = [sum(sorted(biased[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(G)]
                groups = sorted(range(G), key=lambda g: -gscore[g])[: c["topk_group"]]
                cand = [e for g in groups for e in range(g * per, (g + 1) * per)]
                chosen = sorted(cand, key=lambda e: -biased[e])[:k]
                ws = [s[e].item() for e in chosen]
                tot = sum(ws)
                ws = [w / tot * c["routed_scaling_factor"] for w in ws]
            else:
                pr = torch.softmax(logits[t], -1)
                chosen = sorted(range(pr.shape[0]), key=lambda e: -pr[e].item())[:k]
                ws = [pr[e].item() for e in chosen]
            out.append(list(zip(chosen, ws)))
        return out

    def mlp(self, x, prefix):
        g, u, d = (self.w[f"{prefix}.{n}_proj.weight"] for n in ("gate", "up", "down"))
        return (torch.nn.functional.silu(x @ g.t()) * (x @ u.t())) @ d.t()

    def moe(self, x, layer):
        out = torch.zeros_like(x)
        for t, choice in enumerate(self.route(x, layer)):
            for e, w in choice:
                out[t] += w * self.mlp(x[t:t + 1], f"model.layers.{layer}.mlp.experts.{e}")[0]
        shared = "shared_experts" if self.llada2 else "shared_expert"
        if f"model.layers.{layer}.mlp.{shared}.gate_proj.weight" in self.w:
            out += self.mlp(x, f"model.layers.{layer}.mlp.{shared}")
        return out

    def attention(self, x, layer, pos):
        p = f"model.layers.{layer}."
        T = x.shape[0]
        if self.llada2:
            qkv = x @ self.w[p + "attention.query_key_value.weight"].t()
            q, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
            qn, kn, o = "attention.query_layernorm", "attention.key_layernorm", "attention.dense"
        else:
            q, k, v = (x @ self.w[p + f"self_attn.{n}_proj.weight"].t() for n in "qkv")
            qn, kn, o = "self_attn.q_norm", "self_attn.k_norm", "self_attn.o_proj"
        q = self.rms(q.view(T, self.nh, self.hd), self.w[p + qn + ".weight"])
        k = self.rms(k.view(T, self.nkv, self.hd), self.w[p + kn + ".weight"])
        v = v.view(T, self.nkv, self.hd)
        q, k = self.rope(q, pos), self.rope(k, pos)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.hd)
        if self.llada2:   # block-causal
            visible = (pos[None, :] // self.B) <= (pos[:, None] // self.B)
            scores = scores.masked_fill(~visible, float("-inf"))
        att = torch.softmax(scores, -1)
        out = torch.einsum("hqk,khd->qhd", att, v).reshape(T, -1)
        return out @ self.w[p + o + ".weight"].t()

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        emb = "model.word_embeddings.weight" if self.llada2 else "model.embed_tokens.weight"
        h = self.w[emb][ids]
        pos = torch.arange(ids.shape[0])
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = h + self.attention(self.rms(h, self.w[p + "input_layernorm.weight"]), i, pos)
            x = self.rms(h, self.w[p + "post_attention_layernorm.weight"])
            h = h + (self.mlp(x, p + "mlp") if i < self.dense else self.moe(x, i))
        return self.rms(h, self.w["model.norm.weight"]) @ self.w["lm_head.weight"].t()

    # ---------------------------------------------------------------- the official decoding procedure
    @torch.no_grad()
    def generate(self, prompt, gen_length, block_length, threshold, steps=None):
        c = self.cfg
        mask_id, eos_id = c["mask_token_id"], c["eos_token_id"]
        B = block_length
        steps = steps or B
        sched = [B // steps + (1 if i < B % steps else 0) for i in range(steps)]
        P = len(prompt)
        total = -(-(P + gen_length) // B) * B
        x = torch.full((total,), mask_id, dtype=torch.long)
        x[:P] = torch.tensor(prompt)
        for b in range(P // B, total // B):
            bs, be = b * B, (b + 1) * B
            for step in range(steps):
                is_mask = x[bs:be] == mask_id
                is_mask[: max(P - bs, 0)] = False
                if not is_mask.any():
                    break
                visible_end = be if self.llada2 else total
                logits = self.forward(x[:visible_end])[bs:be]
                probs = torch.softmax(logits, -1)
                x0 = probs.argmax(-1)
                conf = torch.where(is_mask, probs.gather(-1, x0[:, None])[:, 0], torch.tensor(float("-inf")))
                n = min(sched[step], int(is_mask.sum()))
                transfer = is_mask & (conf > threshold) if threshold is not None else None
                if transfer is None or int(transfer.sum()) < n:
                    transfer = torch.zeros(B, dtype=torch.bool)
                    transfer[conf.topk(n).indices] = True
                x[bs:be][transfer] = x0[transfer]
            if (x[max(bs, P):be] == eos_id).any():
                break
        out = x[P:P + gen_length].tolist()
        return out[: out.index(eos_id) + 1] if eos_id in out else out
