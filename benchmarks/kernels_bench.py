"""Triton router, confidence and fused-MoE kernels against their torch references on one CUDA GPU (written for the
H200).

Per case: median latency of one isolated call (CUDA events around each call, synchronised before each, after a
warm-up), kernel launches per call (torch.profiler's device events: kernels, with memsets and copies counted apart),
and for the confidence and MoE kernels the effective bandwidth (bytes read once / time) against the HBM peak. The
results are checked on the GPU first: router ids equal (a row may differ only on an exact tie of biased scores,
reported as tie_rows, or on a near-tie that the fused gate's sum order can swap, two deciding scores within
NEAR_TIE, near_tie_rows) and weights within WEIGHT_RTOL relative; the router's and the attention's time inside a
CUDA graph too (*_graph_us: an eager call of either is mostly its launches); x0 equal (or tied in the reference's probabilities) and its
probability within 1e-5 relative, NaN/Inf rows non-finite; MoE pair outputs every one written and within
MOE_MAX_ERR of the largest output and MOE_REL_L2 overall of the torch path's. One JSON line per case on stdout, and
in --out.

    python benchmarks/kernels_bench.py --out kernels.json
    python benchmarks/kernels_bench.py --cases moe --moe-tiles gate_up_n=64,down_n=128 --moe-tiles num_warps=8
    python benchmarks/kernels_bench.py --cases attention --attention-tiles rows=16 --attention-tiles rows=64
    python benchmarks/kernels_bench.py --cases linear --linear-tiles block_n=32 --linear-tiles block_k=128,stages=3

Shapes: router at T in (32, 256, 2048) with LLaDA2.0-mini's gate (H 2048, E 256, 8 groups, top-4 groups, top-8,
bf16 hidden, weight and bias); confidence at B in (32, 256) with V 157,184. Confidence inputs are cycled through
enough copies to exceed twice the L2, so each call reads its logits from HBM. MoE: LLaDA2.0-mini's routed experts
(H 2048, I 512, top-8, bf16, 6 MiB an expert) over a layer's slot pool of S in (256, 103) slots (all resident, a
40 % budget), decode steps of T tokens routed to U unique experts, (T, U) in MOE_ROUTING; fused_swiglu_pairs
against grouped_swiglu + index_copy_ (ExpertManager._grouped's torch path). GB/s count the unique experts' weight
bytes once (192-282 MiB a call, well past the L2; two routings are cycled); floor_us is that at --peak-gbps.

Norm: at T in NORM_TOKENS, LLaDA2.0-mini's hidden 2048 and attention (16 query and 4 KV heads of 128, 64 dims
rotated), bf16: add_rms_norm against the residual add and RMSNorm, qk_norm_rope against the attention prologue
(QK-norm, RoPE, the two index copies), combine_pairs against ExpertManager.combine (top-8); each must give the
reference's bits on NORM_EQUAL_FRACTION of the elements and lie within NORM_MAX_REL of its largest value.

Attention: a chunk of T queries at (start, kv_end) over a KV cache's key_len bucket, ATTENTION_SHAPES, with
LLaDA2.0-mini's heads and block-causal blocks of 32, bf16: the attention kernel against the torch path it replaces
(the model's additive mask, scaled_dot_product_attention, the output's transpose for o_proj); the largest error
within ATTENTION_MAX_REL and the mean within ATTENTION_MEAN_REL of the reference's largest value. Besides the eager
call's time (mostly its launch), each path's time a call inside a CUDA graph of 20 back-to-back calls
(*_graph_us, as the engine replays a forward; the cache then sits in L2); --attention-tiles compares tiles.

Mapped: a decode step (32 tokens, 32 experts) over a layer whose 256 experts sit both in device slots and in a
pinned host store, with m of the step's experts missing from the slot map (m in MAPPED_MISSES), so the kernels read
them from host memory over PCIe: the call's time against m = 0, the mapped bytes' effective GB/s, and the copy
engine's time to copy the same m blobs (what a load into slots costs before the compute can start), and the same call
capturing the m experts into free slots as it reads them (capture=, what --capture-slots runs); outputs must equal
m = 0's bit for bit, and each captured slot must hold its expert's blob.

Linear: the skinny GEMM (oled/kernels/triton_linear.py) against F.linear (cuBLAS) for a decode step of M in
LINEAR_ROWS rows and each of LLaDA2.0-mini's small dense weights (LINEAR_WEIGHTS), bf16: each path's time eager and
inside a CUDA graph (*_graph_us), the weight bytes' effective GB/s (*_gbps, *_graph_gbps) against floor_us, the
largest error of each against an fp32 GEMM of the same inputs and the share of elements beyond one bf16 ulp of it,
the share of the kernel's elements equal to F.linear's. Weights are cycled through enough copies to exceed twice
the L2 (a graph call runs the GEMM once over each copy; its time is per GEMM), so each GEMM reads its weight from
HBM, as in a forward. The kernel must be finite, within an ulp of the largest reference value, and give the same
bits on a second call. The default tiles are always measured; each --linear-tiles adds a configuration.

Exit status: 0 every check passed; 1 a kernel's results differ from its reference (the JSON says where);
2 no CUDA device or no Triton.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter
from types import SimpleNamespace

import torch

CASES = ("router", "confidence", "moe", "moe-fp8", "norm", "attention", "mapped", "linear")
PEAK_GBPS = 4300.0                  # the H200 HBM figure this project compares against (--peak-gbps to change)
ROUTER = dict(top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)     # LLaDA2.0-mini / flash
ROUTER_TOKENS = (32, 256, 2048)
EXPERTS, HIDDEN = 256, 2048
CONFIDENCE_ROWS = (32, 256)
VOCAB = 157_184
# the fused router's gate sums in its own order: logits a few ulps from the reference's, weights within WEIGHT_RTOL;
# a row may route differently only where two of its biased scores lie within NEAR_TIE of each other
WEIGHT_RTOL, PROB_RTOL, NEAR_TIE = 1e-5, 1e-5, 1e-5
MOE_HIDDEN, MOE_INTER, MOE_TOP_K = 2048, 512, 8       # LLaDA2.0-mini's routed experts
MOE_SLOTS = (256, 103)                                 # a layer's slots at 100 % and 40 % of the experts
MOE_ROUTING = ((32, 32), (32, 47), (64, 32), (64, 47))  # (tokens, unique experts) of a decode step
MAPPED_MISSES = (0, 1, 2, 4, 8, 32)                    # of a decode step's 32 experts, read from pinned host memory
# bf16, same rounding points, fp32 sums in another order: elements an ulp or two apart at most
MOE_MAX_ERR, MOE_REL_L2 = 2**-6, 2**-9
NORM_TOKENS = (32, 128)                                # decode chunks: a block, and a block with its neighbours
HEADS, KV_HEADS, HEAD_DIM, ROTARY = 16, 4, 128, 64     # LLaDA2.0-mini's attention
# the norm kernels round where torch rounds; only a mean of squares sums in another order
NORM_EQUAL_FRACTION, NORM_MAX_REL = 0.99, 2**-6
# (tokens, start, kv_end, key_len): a decode block at ~300 keys in its graph's 512-key bucket, the same late in a
# long context, a block with its neighbours
ATTENTION_SHAPES = ((32, 256, 288, 512), (32, 480, 512, 576), (32, 4000, 4032, 4096), (128, 256, 384, 512))
ATTENTION_BLOCK = 32
# bf16 in and out, fp32 sums; P rounded to bf16 before P @ V (as flash attention does) where cuDNN may keep more
ATTENTION_MAX_REL, ATTENTION_MEAN_REL = 2**-6, 2**-9
LINEAR_ROWS = (32, 64)                                 # a decode step's rows: a block, and two
# LLaDA2.0-mini's small dense weights [N, K]: attention QKV and output, the shared expert's gate|up and down, the
# dense first layer's MLP gate|up and down
LINEAR_WEIGHTS = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "shared_gate_up": (1024, 2048),
                  "shared_down": (2048, 512), "dense_gate_up": (10240, 2048), "dense_down": (2048, 5120)}


# ---------------------------------------------------------------------------------------------------------------
# checks (pure tensor code: run on any device)


def compare_routing(want, got, logits, bias, routing=None) -> dict:
    """Reference (ids, weights) vs kernel's. A row whose ids differ is excused as an exact tie (the kernel's experts
    carry exactly the reference's biased scores, in the same order: torch.topk's tie order is its own) or, given
    `routing` (top_k, n_group, topk_group), as a near-tie: two values that decide the row's routing lie within
    NEAR_TIE of each other, which the fused gate's sum order can swap."""
    from oled.models.router import decision_gaps

    ref_ids, ref_w = want
    ids, w = got
    differ = (ids != ref_ids).any(dim=-1)
    choice = torch.sigmoid(logits.float()) + (0.0 if bias is None else bias.float())
    tie = differ & (choice.gather(1, ids) == choice.gather(1, ref_ids)).all(dim=-1)
    near = torch.zeros_like(differ)
    if routing is not None:
        near = differ & ~tie & (decision_gaps(logits.float(), bias, routing["n_group"], routing["topk_group"],
                                              routing["top_k"]) <= NEAR_TIE)
    same = ~differ
    rel = ((w - ref_w).abs() / ref_w.abs().clamp_min(1e-30))[same]
    max_rel = float(rel.max()) if rel.numel() else 0.0
    mismatched = int((differ & ~tie & ~near).sum())
    return {"rows": int(ids.shape[0]), "mismatched_rows": mismatched, "tie_rows": int(tie.sum()),
            "near_tie_rows": int(near.sum()), "max_weight_rel_err": max_rel,
            "ok": mismatched == 0 and max_rel <= WEIGHT_RTOL}


def compare_confidence(want, got, logits) -> dict:
    """Reference (x0, p) vs kernel's. A differing x0 is excused only where the reference's probabilities of both
    indices are equal (the kernel takes the argmax of the logits, the reference of the rounded probabilities)."""
    ref_x0, ref_p = want
    x0, p = got
    differ = x0 != ref_x0
    if differ.any():
        probs = torch.softmax(logits[differ], dim=-1)
        tied = probs.gather(1, x0[differ][:, None]) == probs.gather(1, ref_x0[differ][:, None])
        excused = int(tied.sum())
    else:
        excused = 0
    finite = torch.isfinite(ref_p)
    both = finite & torch.isfinite(p)
    rel = ((p - ref_p).abs() / ref_p.abs().clamp_min(1e-30))[both & ~differ]
    max_rel = float(rel.max()) if rel.numel() else 0.0
    finiteness_agrees = bool(torch.equal(finite, torch.isfinite(p)))
    mismatched = int(differ.sum()) - excused
    return {"rows": int(x0.shape[0]), "mismatched_rows": mismatched, "tie_rows": excused,
            "max_prob_rel_err": max_rel, "finiteness_agrees": finiteness_agrees,
            "ok": mismatched == 0 and max_rel <= PROB_RTOL and finiteness_agrees}


def with_non_finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """The first 6 rows of a copy of logits made non-finite in each way the decoding loop must notice (the
    reference gives NaN probabilities for all six), plus a 7th with -inf entries beside finite ones (finite)."""
    x = logits[:7].clone()
    v = x.shape[1]
    x[0, v // 2] = math.nan
    x[1, v - 1] = math.inf
    x[2, [1, v // 3]] = math.inf
    x[3] = -math.inf
    x[4, 0], x[4, v - 1] = math.nan, math.inf
    x[5, :] = -math.inf
    x[5, v // 2] = math.nan
    x[6, ::2] = -math.inf
    return x


def compare_non_finite(want, got) -> dict:
    """On with_non_finite_rows: x0 as the reference's, non-finite probabilities exactly where the reference has them."""
    (ref_x0, ref_p), (x0, p) = want, got
    ok = bool(torch.equal(x0, ref_x0)) and bool(torch.equal(torch.isfinite(p), torch.isfinite(ref_p)))
    ok = ok and not bool(torch.isfinite(p[:6]).any())
    return {"rows": int(x0.shape[0]), "ok": ok, "x0": x0.tolist(), "reference_x0": ref_x0.tolist(),
            "prob_finite": torch.isfinite(p).tolist()}


def compare_moe(want, got) -> dict:
    """The torch path's pair outputs vs the kernels' (want was filled with NaN first, so a row the kernels left
    unwritten is caught as non-finite)."""
    diff = got.float() - want.float()
    scale = float(want.float().abs().max())
    max_err = float(diff.abs().max())
    rel_l2 = float(diff.norm() / want.float().norm().clamp_min(1e-30))
    finite = bool(torch.isfinite(got).all())
    return {"rows": int(got.shape[0]), "all_written": finite, "max_abs_err": max_err, "max_abs_ref": scale,
            "rel_l2": rel_l2, "equal_fraction": float((got == want).float().mean()),
            "ok": finite and max_err <= MOE_MAX_ERR * scale and rel_l2 <= MOE_REL_L2}


def moe_routing(tokens, unique, slots, top_k, generator) -> torch.Tensor:
    """pair_slots [T * k] of a decode step: `unique` experts, each in a random slot and each routed to at least
    once, k distinct a token, the other pairs drawn with a Zipf popularity (a few experts take many tokens)."""
    if not top_k <= unique <= min(tokens * top_k, slots):
        raise ValueError(f"{unique} unique experts do not fit {tokens} tokens x top-{top_k} over {slots} slots")
    slot_of = torch.randperm(slots, generator=generator)[:unique]
    cover = torch.randperm(unique, generator=generator)
    popularity = 1.0 / torch.arange(1, unique + 1, dtype=torch.float64)
    rows = []
    for t in range(tokens):
        first = cover[t * top_k:(t + 1) * top_k]           # the first tokens route to every expert once
        weights = popularity.clone()
        weights[first] = 0.0
        rest = (torch.multinomial(weights, top_k - len(first), generator=generator) if len(first) < top_k
                else first[:0])
        rows.append(torch.cat([first, rest]))
    return slot_of[torch.stack(rows)].reshape(-1)


# ---------------------------------------------------------------------------------------------------------------
# measurements (CUDA)


def cuda_median_us(fn, inputs, warmup: int, repeats: int) -> float:
    """Median µs of fn(*inputs[i % len(inputs)]) over `repeats` calls, each timed alone with CUDA events after a
    synchronise (so a multi-kernel call pays its launch gaps, as it does in an eager decode step)."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = inputs[i % len(inputs)]
        torch.cuda.synchronize()
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def cuda_graph_us(fn, args, calls: int = 20, repeats: int = 20) -> float:
    """Median µs of one fn(*args) inside a CUDA graph of `calls` back-to-back calls, as the engine replays a forward:
    the GPU's time without the host's launch (an eager call of a small kernel is mostly the launch)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                     # compile and warm up outside the capture
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def per_call(kernels: Counter, other: Counter, calls: int) -> dict:
    """Device events of `calls` calls (kernels by name; memsets and copies by name) -> per-call counts."""
    def each(n):
        return n // calls if n % calls == 0 else n / calls

    return {"launches": each(sum(kernels.values())), "memsets_copies": each(sum(other.values())),
            "kernels": {name: each(n) for name, n in sorted(kernels.items())},
            "other": {name: each(n) for name, n in sorted(other.items())}}


def device_event_kind(event) -> str | None:
    """'kernel', 'other' (a memset or copy) or None (host-side) for a torch.profiler event: by Kineto's activity
    type where the event has one, else by device and name."""
    from torch.autograd import DeviceType

    activity = getattr(event, "activity_type", None)
    if activity:
        return {"kernel": "kernel", "gpu_memcpy": "other", "gpu_memset": "other"}.get(activity)
    if event.device_type != DeviceType.CUDA:
        return None
    return "other" if event.name.startswith(("Memcpy", "Memset")) else "kernel"


def cuda_launches(fn, args, calls: int = 5) -> dict:
    """Per-call device activity of fn(*args) (after warm-up), from torch.profiler's CUDA events."""
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn(*args)
            torch.cuda.synchronize()
        found = {"kernel": Counter(), "other": Counter(), None: Counter()}
        for event in prof.events():
            found[device_event_kind(event)][event.name] += 1
    except Exception as e:          # no CUPTI, a profiler change: the timings still stand
        return {"launches": None, "error": f"{type(e).__name__}: {e}"}
    return per_call(found["kernel"], found["other"], calls)


def gbps(num_bytes: int, us: float) -> float:
    return num_bytes / (us * 1e-6) / 1e9


# ---------------------------------------------------------------------------------------------------------------
# cases (device-agnostic: main passes the CUDA timer and launch counter)


def router_case(tokens, *, device, timer, counter, hidden=HIDDEN, experts=EXPERTS, graph_timer=None,
                seed=0) -> dict:
    from oled.kernels.triton_router import sigmoid_group_route as kernel
    from oled.models.router import sigmoid_group_route as reference

    g = torch.Generator(device=device).manual_seed(seed + tokens)
    x = torch.randn(tokens, hidden, device=device, generator=g).bfloat16()
    w = (torch.randn(experts, hidden, device=device, generator=g) * hidden**-0.5).bfloat16()
    b = (0.1 * torch.randn(experts, device=device, generator=g)).bfloat16()
    args = [(x, w, b)]
    ref = lambda x, w, b: reference(x, w, b, **ROUTER)        # noqa: E731
    tri = lambda x, w, b: kernel(x, w, b, **ROUTER)           # noqa: E731
    gemm = lambda x, w, b: x.float() @ w.float().t()           # noqa: E731  (shared by both)
    check = compare_routing(ref(x, w, b), tri(x, w, b), gemm(x, w, b), b, routing=ROUTER)
    torch_us, triton_us = timer(ref, args), timer(tri, args)
    # inside a graph, as the engine runs them (an eager call is mostly its launches)
    in_graph = ({"torch_graph_us": graph_timer(ref, args[0]), "triton_graph_us": graph_timer(tri, args[0]),
                 "gate_gemm_graph_us": graph_timer(gemm, args[0])} if graph_timer is not None else {})
    return {"case": "router", "tokens": tokens, "hidden": hidden, "experts": experts, **ROUTER,
            "torch_us": torch_us, "triton_us": triton_us, "speedup": torch_us / triton_us, **in_graph,
            "gate_gemm_us": timer(gemm, args), "torch": counter(ref, args[0]), "triton": counter(tri, args[0]),
            "check": check}


def confidence_case(rows, *, device, timer, counter, vocab=VOCAB, copies=1, seed=0, peak_gbps=PEAK_GBPS) -> dict:
    from oled.decoding.rules import predict as reference
    from oled.decoding.rules import with_greedy
    from oled.kernels.triton_confidence import greedy_confidence

    kernel = with_greedy(greedy_confidence)

    g = torch.Generator(device=device).manual_seed(seed + rows)
    inputs = [(torch.randn(rows, vocab, device=device, generator=g) * 4, 0.0, None) for _ in range(copies)]
    logits = inputs[0][0]
    check = compare_confidence(reference(*inputs[0]), kernel(*inputs[0]), logits)
    odd = with_non_finite_rows(logits)
    check["non_finite"] = compare_non_finite(reference(odd, 0.0, None), kernel(odd, 0.0, None))
    check["ok"] = check["ok"] and check["non_finite"]["ok"]
    torch_us, triton_us = timer(reference, inputs), timer(kernel, inputs)
    num_bytes = rows * vocab * 4
    return {"case": "confidence", "rows": rows, "vocab": vocab, "copies": copies, "bytes": num_bytes,
            "torch_us": torch_us, "triton_us": triton_us, "speedup": torch_us / triton_us,
            "torch_gbps": gbps(num_bytes, torch_us), "triton_gbps": gbps(num_bytes, triton_us),
            "peak_gbps": peak_gbps, "triton_fraction_of_peak": gbps(num_bytes, triton_us) / peak_gbps,
            "torch": counter(reference, inputs[0]), "triton": counter(kernel, inputs[0]), "check": check}


def moe_inputs(tokens, unique, slots, hidden, top_k, copies, seed, device, inter):
    """The MoE cases' draws, in one order: the pool's weights (unscaled normals [slots, 3 * inter * hidden], fp32 on
    the CPU), the tokens x [tokens, hidden] bf16, and `copies` (x, pair slots with `unique` experts, output) calls."""
    g = torch.Generator().manual_seed(seed + 1000 * tokens + unique)
    raw = torch.randn(slots, 3 * inter * hidden, generator=g)
    x = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
    args = [(x, moe_routing(tokens, unique, slots, top_k, g).to(device),
             torch.empty(tokens * top_k, hidden, device=device, dtype=torch.bfloat16)) for _ in range(copies)]
    return raw, x, args


def moe_case(tokens, unique, slots, *, device, timer, counter, hidden=MOE_HIDDEN, inter=MOE_INTER, top_k=MOE_TOP_K,
             tiles=None, copies=2, seed=0, peak_gbps=PEAK_GBPS, graph_timer=None) -> dict:
    from dataclasses import asdict

    from oled.kernels.triton_moe import DEFAULT_TILES, fused_swiglu_pairs
    from oled.runtime.grouped import grouped_swiglu

    tiles = tiles or DEFAULT_TILES
    raw, x, args = moe_inputs(tokens, unique, slots, hidden, top_k, copies, seed, device, inter)
    pool = raw.to(device, torch.bfloat16) * hidden**-0.5
    pool[:, 2 * inter * hidden:] *= (hidden / inter) ** 0.5                  # outputs O(1), as h is
    pairs = tokens * top_k
    pair_tokens = torch.arange(pairs, device=device) // top_k

    def reference(x, pair_slots, out):          # ExpertManager._grouped's torch path, every pair served
        order, y = grouped_swiglu(x, pair_tokens, pair_slots, pool, hidden, inter)
        out.index_copy_(0, order, y)

    def fused(x, pair_slots, out):
        fused_swiglu_pairs(x, pair_slots, pool, hidden, inter, out, tiles=tiles)

    want, got = (torch.full_like(args[0][2], math.nan) for _ in range(2))
    reference(x, args[0][1], want)
    fused(x, args[0][1], got)
    check = compare_moe(want, got)
    torch_us, fused_us = timer(reference, args), timer(fused, args)
    weight_bytes = unique * 3 * inter * hidden * pool.element_size()
    # the fused path inside a graph, as the engine replays it (an eager call is mostly its launches); the experts'
    # weights (32-47 x 6 MiB) are beyond L2, so each call reads them from HBM
    in_graph = {}
    if graph_timer is not None:
        us = graph_timer(fused, args[0])
        in_graph = {"fused_graph_us": us, "fused_graph_gbps": gbps(weight_bytes, us)}
    return {"case": "moe", "tokens": tokens, "top_k": top_k, "pairs": pairs, "unique_experts": unique,
            "slots": slots, "hidden": hidden, "intermediate": inter, "tiles": asdict(tiles), **in_graph,
            "weight_bytes": weight_bytes, "torch_us": torch_us, "fused_us": fused_us, "speedup": torch_us / fused_us,
            "torch_gbps": gbps(weight_bytes, torch_us), "fused_gbps": gbps(weight_bytes, fused_us),
            "peak_gbps": peak_gbps, "floor_us": weight_bytes / (peak_gbps * 1e9) * 1e6,
            "fused_fraction_of_peak": gbps(weight_bytes, fused_us) / peak_gbps,
            "torch": counter(reference, args[0]), "fused": counter(fused, args[0]), "check": check}


def moe_fp8_case(tokens, unique, slots, *, device, timer, counter, hidden=MOE_HIDDEN, inter=MOE_INTER,
                 top_k=MOE_TOP_K, tiles=None, copies=2, seed=0, peak_gbps=PEAK_GBPS, graph_timer=None) -> dict:
    """The fused MoE kernels over a pool of FP8 blobs (--expert-dtype fp8) against the same kernels over the bf16
    pool those blobs dequantise to: the outputs' bits (equal by construction) and the times, FP8 reading half the
    bytes."""
    from oled import fp8
    from oled.kernels.triton_moe import DEFAULT_TILES, fused_swiglu_pairs

    tiles = tiles or DEFAULT_TILES
    weights, x, args = moe_inputs(tokens, unique, slots, hidden, top_k, copies, seed, device, inter)
    weights = weights * hidden**-0.5
    weights[:, 2 * inter * hidden:] *= (hidden / inter) ** 0.5
    pool_fp8 = fp8.quantise_blobs(weights, hidden, inter).to(device)
    pool_bf16 = fp8.dequantise_blobs(pool_fp8, hidden, inter, torch.bfloat16)
    pairs = tokens * top_k

    def over(pool):
        return lambda x, pair_slots, out: fused_swiglu_pairs(x, pair_slots, pool, hidden, inter, out, tiles=tiles)

    want, got = (torch.full_like(args[0][2], math.nan) for _ in range(2))
    over(pool_bf16)(x, args[0][1], want)
    over(pool_fp8)(x, args[0][1], got)
    bf16_us, fp8_us = timer(over(pool_bf16), args), timer(over(pool_fp8), args)
    fp8_bytes = unique * fp8.blob_bytes(hidden, inter)
    bf16_bytes = unique * 3 * inter * hidden * 2
    in_graph = {}
    if graph_timer is not None:
        in_graph = {"bf16_graph_us": graph_timer(over(pool_bf16), args[0]),
                    "fp8_graph_us": graph_timer(over(pool_fp8), args[0])}
    return {"case": "moe-fp8", "tokens": tokens, "top_k": top_k, "pairs": pairs, "unique_experts": unique,
            "slots": slots, "hidden": hidden, "intermediate": inter, **in_graph,
            "bf16_bytes": bf16_bytes, "fp8_bytes": fp8_bytes, "bf16_us": bf16_us, "fp8_us": fp8_us,
            "speedup": bf16_us / fp8_us, "fp8_gbps": gbps(fp8_bytes, fp8_us), "peak_gbps": peak_gbps,
            "fp8_floor_us": fp8_bytes / (peak_gbps * 1e9) * 1e6, "fp8": counter(over(pool_fp8), args[0]),
            "check": compare_bits(want, got)}


def mapped_case(misses, *, device, timer, counter, tokens=32, unique=32, experts=EXPERTS, hidden=MOE_HIDDEN,
                inter=MOE_INTER, top_k=MOE_TOP_K, seed=0) -> dict:
    """fused_swiglu_pairs with `misses` of the step's experts read from pinned host memory (host=), against every
    expert in a device slot; and the copy engine's time for those blobs."""
    from oled.kernels.triton_moe import fused_swiglu_pairs

    g = torch.Generator().manual_seed(seed + misses)
    store = torch.randn(experts, 3 * inter * hidden, generator=g).to(torch.bfloat16) * hidden**-0.5
    store[:, 2 * inter * hidden:] *= (hidden / inter) ** 0.5
    store = store.pin_memory() if torch.device(device).type == "cuda" else store
    # every expert in slot = its id, then `misses` free slots for the captured call
    pool = torch.cat([store.to(device), torch.zeros(max(misses, 1), store.shape[1], device=device,
                                                    dtype=store.dtype)])
    x = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
    ids = moe_routing(tokens, unique, experts, top_k, g).to(device)
    used = torch.unique(ids)
    gone = used[torch.randperm(len(used), generator=g)[:misses].to(device)]
    every = torch.arange(experts, device=device)
    slot_map = every.clone()
    slot_map[gone] = -1
    pairs = tokens * top_k

    capture = torch.arange(experts, experts + misses, device=device)

    def run(slot_map, out, capture=None):
        fused_swiglu_pairs(x, ids, pool, hidden, inter, out, slot_map=slot_map, host=store, capture=capture)

    want, got = (torch.full((pairs, hidden), math.nan, device=device, dtype=torch.bfloat16) for _ in range(2))
    run(every, want)
    run(slot_map, got)
    bits = compare_bits(want, got)
    captured_out = torch.full_like(got, math.nan)
    run(slot_map, captured_out, capture)
    in_order = torch.sort(gone).values                      # captured in increasing expert id
    slots_hold = bool(torch.equal(pool[experts:experts + misses].cpu(), store[in_order.cpu()])) if misses else True
    check = {"equal_fraction": bits["equal_fraction"], "all_written": bool(torch.isfinite(got).all()),
             "captured_equal": bool(torch.equal(captured_out, got)), "captured_slots_hold_blobs": slots_hold,
             "ok": bits["equal_fraction"] == 1.0 and bool(torch.isfinite(got).all())
             and bool(torch.equal(captured_out, got)) and slots_hold}
    out = torch.empty(pairs, hidden, device=device, dtype=torch.bfloat16)
    resident_us, mapped_us = timer(run, [(every, out)]), timer(run, [(slot_map, out)])
    captured_us = timer(run, [(slot_map, out, capture)])
    blobs = gone.cpu().tolist()
    slots = pool[:max(misses, 1)]

    def copy():
        for i, e in enumerate(blobs):
            slots[i].copy_(store[e], non_blocking=True)

    copy_us = timer(copy, [()]) if misses else 0.0
    mapped_bytes = misses * store.shape[1] * store.element_size()
    extra_us = mapped_us - resident_us
    return {"case": "mapped", "tokens": tokens, "unique_experts": unique, "mapped_experts": misses,
            "mapped_bytes": mapped_bytes, "resident_us": resident_us, "mapped_us": mapped_us,
            "mapped_extra_us": extra_us, "mapped_gbps": gbps(mapped_bytes, extra_us) if misses and extra_us > 0 else None,
            "copy_us": copy_us, "copy_gbps": gbps(mapped_bytes, copy_us) if misses else None,
            "copy_then_resident_us": copy_us + resident_us, "captured_us": captured_us,
            "capture_extra_us": captured_us - mapped_us, "fused": counter(run, (slot_map, out)), "check": check}


def compare_bits(want, got) -> dict:
    """Share of elements with the reference's bits, and the largest error relative to the largest reference value
    (RoPE's sums can cancel to 0, so an element's own relative error says nothing)."""
    diff = (got.float() - want.float()).abs()
    rel = float(diff.max() / want.float().abs().max().clamp_min(1e-30)) if diff.numel() else 0.0
    equal = float((got == want).float().mean())
    return {"equal_fraction": equal, "max_err_of_max": rel,
            "ok": equal >= NORM_EQUAL_FRACTION and rel <= NORM_MAX_REL}


def norm_case(tokens, *, device, timer, counter, hidden=HIDDEN, seed=0) -> dict:
    from oled.kernels.triton_moe import combine_pairs
    from oled.kernels.triton_norm import add_rms_norm, qk_norm_rope
    from oled.models.layers import RMSNorm, apply_rope, rope_cos_sin
    from oled.runtime.compute import ExpertCompute

    g = torch.Generator(device=device).manual_seed(seed + tokens)
    bf = torch.bfloat16
    rand = lambda *shape: torch.randn(*shape, device=device, generator=g)        # noqa: E731
    x, residual = (3 * rand(tokens, hidden)).to(bf), rand(tokens, hidden).to(bf)
    norm = RMSNorm(hidden, 1e-6).to(device, bf)
    qk_norms = [RMSNorm(HEAD_DIM, 1e-6).to(device, bf) for _ in range(2)]
    with torch.no_grad():
        for n in (norm, *qk_norms):
            n.weight.copy_(1 + 0.3 * rand(n.weight.shape[0]))
    qkv = (2 * rand(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)).to(bf)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    positions = torch.arange(100, 100 + tokens, device=device)
    cos, sin = rope_cos_sin(positions, ROTARY, 600000.0, bf)
    tables = rope_cos_sin(torch.arange(4096, device=device), ROTARY, 600000.0, bf)     # what the model keeps
    caches = [torch.zeros(KV_HEADS, 4096, HEAD_DIM, device=device, dtype=bf) for _ in range(4)]
    y_pairs, weights = rand(tokens * 8, hidden).to(bf), torch.rand(tokens, 8, device=device, generator=g)

    def norm_ref(x, residual):
        total = residual + x
        return norm(total), total

    def prologue_ref(k_cache, v_cache):
        qh, kh = qk_norms[0](q.view(tokens, HEADS, HEAD_DIM)), qk_norms[1](k.view(tokens, KV_HEADS, HEAD_DIM))
        qh, kh = apply_rope(qh, cos, sin), apply_rope(kh, cos, sin)
        k_cache.index_copy_(1, positions, kh.transpose(0, 1))
        v_cache.index_copy_(1, positions, v.view(tokens, KV_HEADS, HEAD_DIM).transpose(0, 1))
        return qh.transpose(0, 1)

    def prologue(k_cache, v_cache):
        return qk_norm_rope(q, k, v, *tables, qk_norms[0].weight, qk_norms[1].weight, 1e-6, positions, k_cache,
                            v_cache)

    combine_ref = lambda y, w: ExpertCompute.combine(SimpleNamespace(fused_combine=None), y, w)   # noqa: E731
    pairs = {
        "add_rms_norm": (norm_ref, lambda x, r: add_rms_norm(x, r, norm.weight, norm.eps), (x, residual)),
        "qk_norm_rope": (prologue_ref, prologue, tuple(caches[:2])),
        "combine": (combine_ref, combine_pairs, (y_pairs, weights)),
    }
    out, ok = {"case": "norm", "tokens": tokens, "hidden": hidden}, True
    with torch.no_grad():
        for name, (ref, fused, args) in pairs.items():
            if name == "qk_norm_rope":
                want, got = ref(*caches[2:]), fused(*caches[:2])
                check = {"q": compare_bits(want, got), "k_cache": compare_bits(caches[2], caches[0]),
                         "v_cache": compare_bits(caches[3], caches[1])}
                check["ok"] = all(c["ok"] for c in check.values())
            else:
                want, got = ref(*args), fused(*args)
                if isinstance(want, tuple):
                    check = {"out": compare_bits(want[0], got[0]), "sum": compare_bits(want[1], got[1])}
                    check["ok"] = check["out"]["ok"] and check["sum"]["ok"]
                else:
                    check = compare_bits(want, got)
            torch_us, triton_us = timer(ref, [args]), timer(fused, [args])
            out[name] = {"torch_us": torch_us, "triton_us": triton_us, "speedup": torch_us / triton_us,
                         "torch": counter(ref, args), "triton": counter(fused, args), "check": check}
            ok = ok and check["ok"]
    out["check"] = {"ok": ok}
    return out


def attention_case(tokens, start, kv_end, key_len, *, device, timer, counter, heads=HEADS, kv_heads=KV_HEADS,
                   head_dim=HEAD_DIM, block_length=ATTENTION_BLOCK, tiles=None, graph_timer=None, seed=0) -> dict:
    import torch.nn.functional as F

    from oled.kernels.triton_attention import attention
    from oled.models.model import MoEDiffusionLM

    g = torch.Generator(device=device).manual_seed(seed + tokens + key_len)
    bf = torch.bfloat16
    q = (2 * torch.randn(tokens, heads, head_dim, device=device, generator=g)).to(bf).transpose(0, 1)
    k_cache, v_cache = (torch.randn(kv_heads, key_len, head_dim, device=device, generator=g).to(bf) for _ in "kv")
    positions = torch.arange(start, start + tokens, device=device)
    end = torch.tensor(kv_end, device=device)
    model = SimpleNamespace(config=SimpleNamespace(block_causal=True), embed=SimpleNamespace(weight=q))

    def torch_path(q, k_cache, v_cache):
        mask = MoEDiffusionLM.attention_mask(model, positions, end, key_len, block_length)
        out = F.scaled_dot_product_attention(q.unsqueeze(0), k_cache.unsqueeze(0), v_cache.unsqueeze(0),
                                             attn_mask=mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1).reshape(tokens, heads * head_dim)

    fused = lambda q, k_cache, v_cache: attention(q, k_cache, v_cache, key_len, positions, end,   # noqa: E731
                                                  block_length, tiles=tiles)
    args = (q, k_cache, v_cache)
    with torch.no_grad():
        want, got = torch_path(*args), fused(*args)
        scale = want.float().abs().max().clamp_min(1e-30)
        err = (got.float() - want.float()).abs() / scale
        check = {"max_err_of_max": float(err.max()), "mean_err_of_max": float(err.mean())}
        check["ok"] = bool(torch.isfinite(got).all()) and check["max_err_of_max"] <= ATTENTION_MAX_REL \
            and check["mean_err_of_max"] <= ATTENTION_MEAN_REL
        torch_us, triton_us = timer(torch_path, [args]), timer(fused, [args])
        # inside a graph, as the engine runs them (an eager call is mostly its launch)
        in_graph = ({"torch_graph_us": graph_timer(torch_path, args), "triton_graph_us": graph_timer(fused, args)}
                    if graph_timer is not None else {})
        # the keys the chunk sees, K and V once: what a pass over them must read
        kv_bytes = 2 * kv_heads * kv_end * head_dim * k_cache.element_size()
        return {"case": "attention", "tokens": tokens, "start": start, "kv_end": kv_end, "key_len": key_len,
                "tiles": tiles._asdict() if tiles else "default", "torch_us": torch_us, "triton_us": triton_us,
                "speedup": torch_us / triton_us, **in_graph,
                "kv_gbps": gbps(kv_bytes, in_graph.get("triton_graph_us", triton_us)),
                "torch": counter(torch_path, args), "triton": counter(fused, args), "check": check}


def copies_beyond_l2(num_bytes: int, l2_bytes: int) -> int:
    """Enough copies of an input that cycling through them never finds the last one still in L2."""
    return max(1, math.ceil(2 * l2_bytes / num_bytes))


def ulps(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s numbers at each of `values` (fp32): eps * 2**floor(log2 |v|), at least the spacing
    of its subnormals (that too at 0)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(values.float())
    spacing = torch.ldexp(torch.full_like(values, info.eps, dtype=torch.float32), exponent - 1)
    return torch.where(values == 0, 0.0, spacing).clamp_min(info.tiny * info.eps)


def linear_errors(want: torch.Tensor, got: torch.Tensor) -> dict:
    """A GEMM's output `got` (its storage dtype) against an fp32 GEMM of the same inputs `want`: the largest error,
    that relative to the largest reference value, and the share of elements farther than one ulp of `got`'s dtype at
    the reference value (a correctly rounded result is half an ulp away; sums that cancel to near 0 can go further in
    any fp32 order)."""
    err = (got.float() - want).abs()
    return {"max_abs_err": float(err.max()) if err.numel() else 0.0,
            "max_err_of_max": float(err.max() / want.abs().max().clamp_min(1e-30)) if err.numel() else 0.0,
            "beyond_one_ulp": float((err > ulps(want, got.dtype)).float().mean()) if err.numel() else 0.0}


def linear_case(rows, n, k, *, device, timer, counter, tiles=None, graph_timer=None, copies=1, name=None, seed=0,
                peak_gbps=PEAK_GBPS) -> dict:
    """x [rows, k] @ W [n, k]^T in bf16: F.linear against the skinny Triton GEMM (tiles: None for its defaults),
    over `copies` copies of the weight in turn."""
    import torch.nn.functional as F

    from oled.kernels.linear_kernel import skinny_linear_kernel
    from oled.kernels.triton_linear import default_tiles, linear
    from oled.kernels.triton_support import interpreted

    g = torch.Generator(device=device).manual_seed(seed + rows + n + k)
    bf = torch.bfloat16
    x = torch.randn(rows, k, device=device, generator=g).to(bf)
    weights = [(torch.randn(n, k, device=device, generator=g) / math.sqrt(k)).to(bf) for _ in range(copies)]
    used = tiles or default_tiles(rows, n, k, interpreted(skinny_linear_kernel))
    fused = lambda x, w: linear(x, w, tiles=tiles)                                  # noqa: E731

    def each_copy(fn):
        """fn over every weight copy in turn: one graph call, `copies` GEMMs."""
        return lambda x, *ws: [fn(x, w) for w in ws]

    with torch.no_grad():
        w = weights[0]
        want = F.linear(x.float(), w.float())
        ref, got = F.linear(x, w), fused(x, w)
        check = {"torch": linear_errors(want, ref), "triton": linear_errors(want, got),
                 "equal_to_torch_fraction": float((got == ref).float().mean()),
                 "deterministic": bool(torch.equal(got, fused(x, w)))}
        largest = want.abs().max()
        check["ok"] = bool(torch.isfinite(got).all()) and check["deterministic"] \
            and check["triton"]["max_abs_err"] <= float(ulps(largest, bf))
        inputs = [(x, w) for w in weights]
        torch_us, triton_us = timer(F.linear, inputs), timer(fused, inputs)
        weight_bytes = n * k * w.element_size()
        record = {"case": "linear", "weight": name, "rows": rows, "n": n, "k": k, "copies": copies,
                  "tiles": used._asdict(), "default_tiles": tiles is None, "weight_bytes": weight_bytes,
                  "floor_us": weight_bytes / (peak_gbps * 1e3), "torch_us": torch_us, "triton_us": triton_us,
                  "speedup": torch_us / triton_us, "torch_gbps": gbps(weight_bytes, torch_us),
                  "triton_gbps": gbps(weight_bytes, triton_us)}
        if graph_timer is not None:         # as the engine replays a forward; an eager call is mostly its launch
            args = (x, *weights)
            for path, fn in (("torch", F.linear), ("triton", fused)):
                us = graph_timer(each_copy(fn), args) / copies
                record.update({f"{path}_graph_us": us, f"{path}_graph_gbps": gbps(weight_bytes, us)})
            record["graph_speedup"] = record["torch_graph_us"] / record["triton_graph_us"]
        return dict(record, torch=counter(F.linear, (x, w)), triton=counter(fused, (x, w)), check=check)


# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="also write the JSON lines to this file")
    p.add_argument("--repeats", type=int, default=50, help="timed calls per measurement (median; at least 20)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first (the first compiles the kernels)")
    p.add_argument("--peak-gbps", type=float, default=PEAK_GBPS, help="HBM bandwidth to compare against, GB/s")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} "
                                                               "(default: all)")
    p.add_argument("--moe-tiles", action="append", metavar="FIELD=N,...",
                   help="fused-MoE tiles to measure instead of the defaults (oled.kernels.triton_moe.MoeTiles "
                        "fields, e.g. gate_up_n=64,down_n=128,num_warps=8); repeat for several configurations")
    p.add_argument("--attention-tiles", action="append", metavar="FIELD=N,...",
                   help="attention tiles to measure instead of the defaults (oled.kernels.triton_attention."
                        "AttentionTiles fields rows, block_n, warps, stages; those not given: the default's for the "
                        "shape); repeat for several configurations")
    p.add_argument("--linear-tiles", action="append", metavar="FIELD=N,...",
                   help="skinny-GEMM tiles to measure besides the defaults (oled.kernels.triton_linear.LinearTiles "
                        "fields block_n, block_k, warps, stages; those not given: the default's for the shape); "
                        "repeat for several configurations")
    args = p.parse_args(argv)
    if args.repeats < 20:
        p.error("--repeats must be at least 20")
    args.cases = [c for c in args.cases.split(",") if c]
    if not args.cases or set(args.cases) - set(CASES):
        p.error(f"--cases takes a comma-separated list of {', '.join(CASES)}")
    try:
        args.moe_tiles = [parse_tiles(spec) for spec in args.moe_tiles or [""]]
    except (TypeError, ValueError) as e:
        p.error(f"--moe-tiles: {e}")
    try:
        args.attention_tiles = [parse_fields(spec) for spec in args.attention_tiles or [""]]
        for fields in args.attention_tiles:
            attention_tiles(fields, tokens=1)             # unknown fields fail here, not after the other cases
    except ValueError as e:
        p.error(f"--attention-tiles: {e}")
    try:
        args.linear_tiles = [None] + [parse_fields(spec) for spec in args.linear_tiles or []]
        for fields in args.linear_tiles[1:]:
            linear_tiles(fields, 32, *LINEAR_WEIGHTS["o_proj"])     # unknown fields fail here, not after other cases
    except ValueError as e:
        p.error(f"--linear-tiles: {e}")
    return args


def parse_fields(spec: str) -> dict[str, int]:
    """"gate_up_n=64,num_warps=8" -> {"gate_up_n": 64, "num_warps": 8}."""
    return {name: int(value) for name, value in (item.split("=", 1) for item in spec.split(",") if item)}


def parse_tiles(spec: str):
    """"gate_up_n=64,num_warps=8" -> MoeTiles with those fields, the defaults for the others."""
    from oled.kernels.triton_moe import MoeTiles

    return MoeTiles(**parse_fields(spec))


def with_fields(default, fields: dict[str, int]):
    """The NamedTuple `default` with `fields` replaced; an unknown field is a ValueError naming the known ones."""
    unknown = set(fields) - set(default._fields)
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}: {type(default).__name__} has "
                         f"{', '.join(default._fields)}")
    return default._replace(**fields)


def attention_tiles(fields: dict[str, int], tokens: int, heads: int = HEADS, kv_heads: int = KV_HEADS):
    """AttentionTiles with `fields`, the compiled default's for the shape for the others; None for no fields."""
    from oled.kernels.triton_attention import default_tiles

    if not fields:
        return None
    return with_fields(default_tiles(tokens * (heads // kv_heads), interpreting=False), fields)


def linear_tiles(fields: dict[str, int] | None, rows: int, n: int, k: int):
    """LinearTiles with `fields`, the compiled default's for the shape for the others; None (the launcher's
    defaults) for None."""
    from oled.kernels.triton_linear import default_tiles

    if fields is None:
        return None
    tiles = with_fields(default_tiles(rows, n, k, interpreting=False), fields)
    if tiles.block_n < 16 or tiles.block_k < 16:
        raise ValueError(f"block_n and block_k must be at least 16, got {tiles.block_n} and {tiles.block_k}")
    return tiles


def environment() -> dict:
    import triton

    from oled.env import git_info

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "git": git_info()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_bench: needs a CUDA device (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    from oled.kernels import triton_support

    if not triton_support.available():
        print("kernels_bench: needs Triton (pip install triton)", file=sys.stderr)
        return 2
    timer = lambda fn, inputs: cuda_median_us(fn, inputs, args.warmup, args.repeats)     # noqa: E731
    env = environment()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    out = open(args.out, "w") if args.out else None
    failed = []
    try:
        cases = []
        if "router" in args.cases:
            cases += [lambda t=t: router_case(t, device="cuda", timer=timer, counter=cuda_launches,
                                              graph_timer=cuda_graph_us)
                      for t in ROUTER_TOKENS]
        if "confidence" in args.cases:
            cases += [lambda r=r: confidence_case(r, device="cuda", timer=timer, counter=cuda_launches,
                                                  copies=copies_beyond_l2(r * VOCAB * 4, l2),
                                                  peak_gbps=args.peak_gbps)
                      for r in CONFIDENCE_ROWS]
        if "moe" in args.cases:
            cases += [lambda t=t, u=u, s=s, tiles=tiles: moe_case(t, u, s, device="cuda", timer=timer,
                                                                  counter=cuda_launches, tiles=tiles,
                                                                  peak_gbps=args.peak_gbps, graph_timer=cuda_graph_us)
                      for tiles in args.moe_tiles for s in MOE_SLOTS for t, u in MOE_ROUTING]
        if "moe-fp8" in args.cases:
            cases += [lambda t=t, u=u, s=s: moe_fp8_case(t, u, s, device="cuda", timer=timer, counter=cuda_launches,
                                                         peak_gbps=args.peak_gbps, graph_timer=cuda_graph_us)
                      for s in MOE_SLOTS for t, u in MOE_ROUTING]
        if "mapped" in args.cases:
            cases += [lambda m=m: mapped_case(m, device="cuda", timer=timer, counter=cuda_launches)
                      for m in MAPPED_MISSES]
        if "norm" in args.cases:
            cases += [lambda t=t: norm_case(t, device="cuda", timer=timer, counter=cuda_launches) for t in NORM_TOKENS]
        if "attention" in args.cases:
            cases += [lambda shape=shape, fields=fields: attention_case(
                          *shape, device="cuda", timer=timer, counter=cuda_launches,
                          tiles=attention_tiles(fields, shape[0]), graph_timer=cuda_graph_us)
                      for fields in args.attention_tiles for shape in ATTENTION_SHAPES]
        if "linear" in args.cases:
            cases += [lambda m=m, name=name, n=n, k=k, fields=fields: linear_case(
                          m, n, k, device="cuda", timer=timer, counter=cuda_launches, name=name,
                          tiles=linear_tiles(fields, m, n, k), graph_timer=cuda_graph_us,
                          copies=copies_beyond_l2(n * k * 2, l2), peak_gbps=args.peak_gbps)
                      for fields in args.linear_tiles for m in LINEAR_ROWS for name, (n, k) in LINEAR_WEIGHTS.items()]
        for case in cases:
            record = {"bench": "kernels", **case(), "env": env}
            line = json.dumps(record)
            print(line, flush=True)
            if out:
                out.write(line + "\n")
                out.flush()
            if not record["check"]["ok"]:
                failed.append(record)
    finally:
        if out:
            out.close()
    for r in failed:
        print(f"kernels_bench: FAILED {r['case']} {r.get('tokens', r.get('rows'))}: {json.dumps(r['check'])}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
