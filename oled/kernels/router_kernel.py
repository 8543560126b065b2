"""Triton kernel: LLaDA2 sigmoid group-limited routing from gate logits, a block of token rows a program.

Imports Triton unconditionally; only oled.kernels.triton_router imports this module, and only when Triton is
available. The launcher and the semantics are documented there.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .kernel_math import exact_dot


@triton.jit
def _sigmoid(x, PRECISE: tl.constexpr):
    """torch's fp32 sigmoid, 1 / (1 + exp(-x)), as its CUDA kernel computes it (expf, IEEE division). Compiled,
    tl.exp is ex2.approx and `/` is div.full, each an ulp or two away, and an ulp is enough to reorder two
    near-equal scores; libdevice's expf and a correctly rounded division are torch's operations (that the bits
    agree is checked on the GPU by benchmarks/kernels_bench.py). The interpreter has no libdevice, so it takes
    numpy's exp, whose last ulp differs from torch's CPU exp for some inputs whatever we do."""
    if PRECISE:
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + e)


@triton.jit
def sigmoid_group_route_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr,
    num_tokens, logits_row_stride, split_stride, routed_scaling_factor,
    N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORMALISE: tl.constexpr, PRECISE: tl.constexpr, SPLITS: tl.constexpr,
):
    """logits [T, N_GROUP * GROUP_SIZE] fp32 -> ids [T, TOP_K] int64, weights [T, TOP_K] fp32, BLOCK_T rows a
    program. With SPLITS > 1 the logits are the sum of SPLITS partial matrices split_stride apart (the gate GEMM's
    ranges of the hidden dimension, gate_partials_kernel), added in order: the same sum on every call.

    Rows are held as [token, group, expert-in-group] tiles, so group reductions run along axis 2 and whole-row
    reductions along axes 2 then 1. Every selection is max-then-lowest-index: among equal values the lowest
    expert (or group) index wins.
    """
    token = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    group = tl.arange(0, BLOCK_G)[None, :, None]
    member = tl.arange(0, BLOCK_S)[None, None, :]
    in_row = (group < N_GROUP) & (member < GROUP_SIZE)
    expert = group * GROUP_SIZE + member                         # flat expert index, [1, BLOCK_G, BLOCK_S]
    no_expert = N_GROUP * GROUP_SIZE                             # index sentinel above every real expert

    here = logits_ptr + token * logits_row_stride + expert
    loaded = in_row & (token < num_tokens)
    logits = tl.load(here, mask=loaded, other=0.0)
    for split in tl.static_range(1, SPLITS):
        logits += tl.load(here + split * split_stride, mask=loaded, other=0.0)
    scores = _sigmoid(logits, PRECISE)
    choice = scores
    if HAS_BIAS:
        # the bias is loaded at its own precision and widened exactly, as the reference's expert_bias.float()
        choice = scores + tl.load(bias_ptr + expert, mask=in_row, other=0.0).to(tl.float32)
    choice = tl.where(in_row, choice, float("-inf"))              # padding never wins

    if N_GROUP > 1:
        # group score = sum of the group's two best biased scores (values only, so ties cannot change it)
        best = tl.max(choice, axis=2)[:, :, None]
        best_at = tl.min(tl.where(choice == best, member, BLOCK_S), axis=2)[:, :, None]
        second = tl.max(tl.where(member == best_at, float("-inf"), choice), axis=2)[:, :, None]
        group_scores = best + second                             # [BLOCK_T, BLOCK_G, 1]; padding groups: -inf
        kept = tl.zeros([BLOCK_T, BLOCK_G, 1], tl.int1)         # full shape: loop-carried types stay fixed
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(group_scores, axis=1)[:, None, :]
            pick = tl.min(tl.where(group_scores == top, group, BLOCK_G), axis=1)[:, None, :]
            kept = kept | (group == pick)
            group_scores = tl.where(group == pick, float("-inf"), group_scores)
        choice = tl.where(kept, choice, float("-inf"))

    # top-k by repeated max: descending order like torch.topk(sorted=True); the weight is the unbiased score
    slot = tl.arange(0, BLOCK_K)[None, :]
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for i in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, axis=2), axis=1)[:, None, None]
        pick = tl.min(tl.min(tl.where(choice == top, expert, no_expert), axis=2), axis=1)[:, None, None]
        picked = expert == pick
        score = tl.sum(tl.sum(tl.where(picked, scores, 0.0), axis=2), axis=1)
        ids = tl.where(slot == i, pick.reshape(BLOCK_T, 1), ids)
        weights = tl.where(slot == i, score[:, None], weights)
        choice = tl.where(picked, float("-inf"), choice)

    if NORMALISE:
        weights = tl.math.div_rn(weights, tl.sum(weights, axis=1)[:, None] + 1e-20)   # unused slots hold 0
    weights = weights * routed_scaling_factor
    row = token.reshape(BLOCK_T, 1)
    out = row * TOP_K + slot
    done = (row < num_tokens) & (slot < TOP_K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=done)
    tl.store(weights_ptr + out, weights, mask=done)


@triton.jit
def gate_partials_kernel(
    hidden_ptr, weight_ptr, out_ptr,
    num_tokens, num_experts, hidden_size, hidden_row_stride, weight_row_stride, split_stride,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """LLaDA2's gate logits in fp32, in partial sums: grid (token blocks, expert blocks, splits); program (t, e, s)
    writes out[s, tokens, experts] = hidden[tokens, K_s] @ weight[experts, K_s]^T (exact_dot: WIDEN for fp32 or mixed
    operands, and under the interpreter) over the s-th range K_s of
    K_PER_SPLIT hidden dims (the last one cut at hidden_size), walking it BLOCK_K at a time. The route kernel adds
    the splits. A 32-token decode step is one block of tokens, so the splits are what spread the 2,048-wide
    reduction over enough programs to read the weight at bandwidth."""
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    expert = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    first = tl.program_id(2) * K_PER_SPLIT
    token_ok, expert_ok = token < num_tokens, expert < num_experts
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for offset in tl.static_range(0, K_PER_SPLIT, BLOCK_K):
        k = first + offset + tl.arange(0, BLOCK_K)
        k_ok = k < hidden_size
        x = tl.load(hidden_ptr + token.to(tl.int64)[:, None] * hidden_row_stride + k[None, :],
                    mask=token_ok[:, None] & k_ok[None, :], other=0.0)                   # [BLOCK_T, BLOCK_K]
        w = tl.load(weight_ptr + expert.to(tl.int64)[None, :] * weight_row_stride + k[:, None],
                    mask=expert_ok[None, :] & k_ok[:, None], other=0.0)                  # [BLOCK_K, BLOCK_E]
        acc = exact_dot(x, w, acc, WIDEN)
    out = out_ptr + tl.program_id(2).to(tl.int64) * split_stride
    tl.store(out + token.to(tl.int64)[:, None] * num_experts + expert[None, :], acc,
             mask=token_ok[:, None] & expert_ok[None, :])
