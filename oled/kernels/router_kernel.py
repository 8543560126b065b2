"""Triton kernel: LLaDA2 sigmoid group-limited routing from gate logits, a block of token rows a program.

Imports Triton unconditionally; only oled.kernels.triton_router imports this module, and only when Triton is
available. The launcher and the semantics are documented there.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice


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
    num_tokens, logits_row_stride, routed_scaling_factor,
    N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORMALISE: tl.constexpr, PRECISE: tl.constexpr,
):
    """logits [T, N_GROUP * GROUP_SIZE] fp32 -> ids [T, TOP_K] int64, weights [T, TOP_K] fp32, BLOCK_T rows a
    program.

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

    logits = tl.load(logits_ptr + token * logits_row_stride + expert, mask=in_row & (token < num_tokens),
                     other=0.0)
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
