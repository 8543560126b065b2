"""Routers as pure functions: hidden states in, (expert ids, routing weights) out. No state, no parameters owned.

Precision follows the official code as loaded in the model dtype (bf16 in practice):
- LLaDA2 computes the gate logits and the sigmoid in fp32, but its `expert_bias` is a buffer that loading in bf16
  casts to bf16, so the bias added for selection carries bf16 rounding (the engine stores it in the model dtype).
- LLaDA-MoE's gate is a plain linear layer in the model dtype; only the softmax over its logits is fp32, and the
  combine weights are cast back to the model dtype.
In fp32 every step is fp32 and the two descriptions coincide.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels import triton_router


def gate_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """LLaDA2's gate logits [T, E], in fp32 (the fused router's gate kernel: the same products, its own sum order)."""
    return hidden.float() @ weight.float().t()


def sigmoid_group_route(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    expert_bias: torch.Tensor | None,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA2 routing: sigmoid scores, group-limited top-k on bias-shifted scores, weights from unbiased scores.

    hidden [T, H], weight [E, H], expert_bias [E] (any dtype; used at its own precision) -> ids [T, k] (int64),
    weights [T, k] (fp32).
    """
    scores = torch.sigmoid(gate_logits(hidden, weight))
    choice = scores if expert_bias is None else scores + expert_bias.float()
    num_tokens, num_experts = choice.shape
    if n_group > 1:
        # A group's score is the sum of its two best biased scores; only the best `topk_group` groups stay.
        group_scores = choice.view(num_tokens, n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask.unsqueeze(-1).expand(num_tokens, n_group, num_experts // n_group).reshape(
            num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * routed_scaling_factor


def decision_gaps(logits: torch.Tensor, bias: torch.Tensor | None, n_group: int, topk_group: int,
                  top_k: int) -> torch.Tensor:
    """Per row of fp32 gate logits [T, E], the smallest gap between two biased scores (or group scores) whose order
    decides sigmoid_group_route's ids: a row whose logits move by less than that, in sigmoid space, routes the same.
    Tests draw inputs clear of near-ties with it; benchmarks/kernels_bench.py excuses near-ties with it."""
    choice = torch.sigmoid(logits) + (0.0 if bias is None else bias.float())
    rows, experts = choice.shape
    gap = torch.full((rows,), math.inf, device=logits.device)
    if rows == 0:
        return gap
    if n_group > 1:
        groups = choice.view(rows, n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
        if topk_group < n_group:
            g = groups.topk(topk_group + 1, dim=-1).values
            gap = g[:, -2] - g[:, -1]
        kept = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(experts // n_group, dim=1), -math.inf)
    candidates = min(top_k + 1, int(torch.isfinite(choice[0]).sum()))
    v = choice.topk(candidates, dim=-1).values
    if candidates > 1:
        gap = torch.minimum(gap, (v[:, :-1] - v[:, 1:]).min(dim=-1).values)
    return gap


def softmax_route(
    hidden: torch.Tensor, weight: torch.Tensor, expert_bias: torch.Tensor | None = None, *, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA-MoE routing: logits in the model dtype, softmax over experts in fp32, plus the expert bias if the
    checkpoint has one, top-k. The weights are the selected (biased) values, not renormalised (the official block
    fixes norm_topk_prob to False whatever the config says), rounded to the model dtype.

    hidden [T, H], weight [E, H] -> ids [T, k] (int64), weights [T, k] (fp32 holding model-dtype values).
    """
    probs = torch.softmax(F.linear(hidden, weight.to(hidden.dtype)).float(), dim=-1)   # the official nn.Linear
    if expert_bias is not None:
        probs = probs + expert_bias.float()
    weights, ids = probs.topk(top_k, dim=-1)
    return ids, weights.to(hidden.dtype).float()


def route(config, hidden: torch.Tensor, weight: torch.Tensor, expert_bias: torch.Tensor | None,
          fused: bool = False):
    """Dispatch on the model's router kind (see ModelConfig.router). fused: LLaDA2's gate GEMM and routing as Triton
    kernels (oled/kernels/triton_router.py; the same ids and weights up to the fp32 sums' order)."""
    bias = expert_bias if config.use_expert_bias else None
    if config.router == "sigmoid_group":
        group_route = triton_router.sigmoid_group_route if fused else sigmoid_group_route
        return group_route(
            hidden, weight, bias, top_k=config.top_k, n_group=config.n_group, topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor, norm_topk_prob=config.norm_topk_prob)
    return softmax_route(hidden, weight, bias, top_k=config.top_k)
