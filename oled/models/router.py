"""Routers as pure functions: hidden states in, (expert ids, routing weights) out. No state, no parameters owned.

Both compute in fp32 whatever the model dtype, as the official implementations do.
"""
from __future__ import annotations

import torch


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

    hidden [T, H], weight [E, H], expert_bias [E] -> ids [T, k] (int64), weights [T, k] (fp32).
    """
    logits = hidden.float() @ weight.float().t()
    scores = torch.sigmoid(logits)
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


def softmax_route(
    hidden: torch.Tensor, weight: torch.Tensor, *, top_k: int, norm_topk_prob: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA-MoE routing: softmax over experts, top-k; weights are the selected probabilities (renormalised only
    if the config says so)."""
    probs = torch.softmax(hidden.float() @ weight.float().t(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def route(config, hidden: torch.Tensor, weight: torch.Tensor, expert_bias: torch.Tensor | None):
    """Dispatch on the model's router kind (see ModelConfig.router)."""
    if config.router == "sigmoid_group":
        return sigmoid_group_route(
            hidden, weight, expert_bias if config.use_expert_bias else None, top_k=config.top_k,
            n_group=config.n_group, topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor, norm_topk_prob=config.norm_topk_prob)
    return softmax_route(hidden, weight, top_k=config.top_k, norm_topk_prob=config.norm_topk_prob)
