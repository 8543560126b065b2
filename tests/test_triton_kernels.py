"""Triton kernels (fused LLaDA2 router, greedy confidence) against their torch references in fp32, on the CPU
through Triton's interpreter; plus an ahead-of-time compile of the same kernels and of the fused MoE's
(tests/test_triton_moe.py tests those) for sm_90 (the H200), which checks the compiled-only code (libdevice expf,
correctly rounded division, vector loads, tensor-core MMA) without a GPU."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from oled.decoding.rules import predict as predict_reference
from oled.decoding.rules import with_greedy
from oled.models.router import decision_gaps
from oled.models.router import sigmoid_group_route as route_reference
from tests.triton_interpreter import compile_for_sm90, import_triton_for_the_interpreter, interpreted_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

triton = import_triton_for_the_interpreter()

# The interpreter evaluates both sides of every tl.where in numpy, which warns about the side thrown away
# (exp(-inf - -inf) in a lane that saw only padding, 1 / 0 in a row the NaN branch answers).
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")]


@pytest.fixture(scope="module")
def k():
    """The launchers, with their kernels built for the interpreter (which the rest of this process keeps: only
    the Triton kernel tests use Triton in-process)."""
    mp = interpreted_kernels("kernel_math", "router_kernel", "confidence_kernel")
    from oled.kernels import confidence_kernel, router_kernel, triton_confidence, triton_router, triton_support

    assert triton_support.interpreted(router_kernel.sigmoid_group_route_kernel)
    assert triton_support.interpreted(confidence_kernel.scan_kernel)
    yield SimpleNamespace(route=triton_router.sigmoid_group_route, route_logits=triton_router.sigmoid_group_route_logits,
                          confidence=triton_confidence.greedy_confidence,
                          predict=with_greedy(triton_confidence.greedy_confidence),
                          router=triton_router, conf=triton_confidence)
    mp.undo()


# ---------------------------------------------------------------------------------------------------------------
# router

# Exact ids need exactly ordered scores. The interpreter's sigmoid uses numpy's exp, which differs from torch's CPU
# exp in the last ulp for ~1 in 6 inputs, so two biased scores within an ulp could swap; test inputs therefore keep
# every decision (the k-th/k+1-th group, each adjacent pair of the top k+1 experts) at least this far apart, which
# any correctly rounded-ish sigmoid orders the same (8 ulps at 1.0). About 1 row in 2,000 is redrawn.
MIN_GAP = 1e-6


def routing_case(tokens, experts, n_group, topk_group, top_k, bias_dtype=torch.float32, seed=0, hidden=64,
                 spread=1.0, dtype=torch.float32):
    """hidden [T, H] and gate weight [E, H] in `dtype`, expert_bias [E] or None; logits ~ N(0, spread^2) with
    every routing decision at least MIN_GAP apart (rows that are not get redrawn)."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(experts, hidden, generator=g) * hidden**-0.5).to(dtype)
    bias = None if bias_dtype is None else (0.1 * torch.randn(experts, generator=g)).to(bias_dtype)
    x = (torch.randn(tokens, hidden, generator=g) * spread).to(dtype)
    for _ in range(20):
        close = decision_gaps(x.float() @ weight.float().t(), bias, n_group, topk_group, top_k) < MIN_GAP
        if not close.any():
            return x, weight, bias
        x[close] = (torch.randn(int(close.sum()), hidden, generator=g) * spread).to(dtype)
    raise AssertionError("could not draw well-separated routing inputs")


def assert_same_routing(got, want):
    ids, weights = got
    ref_ids, ref_weights = want
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids), f"{int((ids != ref_ids).any(-1).sum())} rows route differently"
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)


ROUTER_SHAPES = [
    # experts, n_group, topk_group, top_k, tokens
    (256, 8, 4, 8, 1),        # LLaDA2.0-mini/flash, one token
    (256, 8, 4, 8, 37),       # ragged: not a multiple of the interpreter's rows a program
    (64, 8, 4, 8, 1),         # the bundled tiny model
    (64, 8, 4, 8, 19),
    (256, 1, 1, 8, 33),       # no group limit
    (8, 2, 1, 2, 1),          # tiny: one group of two kept
    (8, 2, 1, 2, 50),
]


@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16], ids=["no-bias", "fp32", "bf16"])
@pytest.mark.parametrize("experts,n_group,topk_group,top_k,tokens", ROUTER_SHAPES)
def test_router_matches_reference(k, experts, n_group, topk_group, top_k, tokens, bias_dtype):
    x, w, b = routing_case(tokens, experts, n_group, topk_group, top_k, bias_dtype, seed=tokens * experts)
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    assert_same_routing(k.route(x, w, b, **kw), route_reference(x, w, b, **kw))


@pytest.mark.parametrize("top_k,norm,scale,spread", [(8, False, 1.0, 1.0), (1, True, 2.5, 1.0), (8, True, 1.0, 4.0)],
                         ids=["unnormalised", "top-1", "wide-logits"])
def test_router_options(k, top_k, norm, scale, spread):
    """Weights not renormalised, top-1 (never renormalised), and logits wide enough to saturate the sigmoid."""
    x, w, b = routing_case(29, 64, 8, 4, top_k, seed=top_k, spread=spread)
    kw = dict(top_k=top_k, n_group=8, topk_group=4, routed_scaling_factor=scale, norm_topk_prob=norm)
    assert_same_routing(k.route(x, w, b, **kw), route_reference(x, w, b, **kw))


def test_router_many_tokens(k):
    """One moderately sized batch in the LLaDA2 shape, in the model's dtype: bf16 hidden states, weight and bias."""
    x, w, b = routing_case(2048, 256, 8, 4, 8, torch.bfloat16, seed=7, dtype=torch.bfloat16)
    kw = dict(top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    assert_same_routing(k.route(x, w, b, **kw), route_reference(x, w, b, **kw))


def test_router_from_strided_logits(k):
    """Logits that are a column slice of a wider matrix (row stride != E) route like their contiguous copy."""
    x, w, b = routing_case(21, 64, 8, 4, 8, seed=3)
    wide = torch.cat([x @ w.t(), torch.randn(21, 7)], dim=1)[:, :64]
    kw = dict(top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    assert wide.stride(0) == 71
    assert_same_routing(k.route_logits(wide, b, **kw), route_reference(x, w, b, **kw))


def test_router_ties_go_to_the_lowest_index(k):
    """The documented tie rule, on exactly equal scores: lowest expert index first, lowest group kept."""
    kw = dict(routed_scaling_factor=1.0)
    flat = torch.zeros(2, 8)                                              # every expert ties
    ids, weights = k.route_logits(flat, None, top_k=2, n_group=1, topk_group=1, **kw)
    assert ids.tolist() == [[0, 1], [0, 1]]
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5), rtol=1e-6, atol=0)
    twins = torch.tensor([[3.0, 1.0, 2.0, 0.0, 3.0, 1.0, 2.0, 0.0]])     # both groups score the same
    ids, _ = k.route_logits(twins, None, top_k=2, n_group=2, topk_group=1, **kw)
    assert ids.tolist() == [[0, 2]]
    ids, _ = k.route_logits(twins, None, top_k=4, n_group=1, topk_group=1, **kw)
    assert ids.tolist() == [[0, 4, 2, 6]]
    # the reference picks some order among ties; the kernel's choice is an equally valid top-k of the same values
    ref_ids, _ = route_reference(twins, torch.eye(8), None, top_k=4, n_group=1, topk_group=1, **kw)
    assert torch.equal(twins.gather(1, ids), twins.gather(1, ref_ids))


@pytest.mark.parametrize("tokens,experts,hidden,x_dtype,w_dtype", [
    (1, 8, 16, torch.float32, torch.float32),         # one step of the hidden dimension, one split
    (37, 64, 100, torch.bfloat16, torch.bfloat16),    # ragged everywhere: tokens, and the last split's steps
    (33, 256, 256, torch.bfloat16, torch.float32),    # mixed operands: both widened
    (16, 24, 48, torch.float16, torch.float16)])
def test_gate_partials_add_up_to_the_reference_logits(k, tokens, experts, hidden, x_dtype, w_dtype):
    """The gate kernel's partial sums over ranges of the hidden dimension, added in order as the routing kernel
    adds them, are the reference's fp32 logits (x.float() @ w.float().t()) up to the sums' order."""
    g = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(x_dtype)
    w = (torch.randn(experts, hidden, generator=g) * hidden**-0.5).to(w_dtype)
    parts = k.router.gate_partials(x, w)
    assert parts.dtype == torch.float32 and parts.shape == (math.ceil(hidden / 32), tokens, experts)
    got = parts[0].clone()
    for part in parts[1:]:
        got += part
    torch.testing.assert_close(got, x.float() @ w.float().t(), rtol=1e-5, atol=1e-5)


def test_gate_partials_read_strided_rows_and_refuse_bad_operands(k):
    x = torch.randn(5, 80)
    w = torch.randn(16, 64)
    parts = k.router.gate_partials(x[:, :64], w)                      # rows 80 apart
    torch.testing.assert_close(parts.sum(0), x[:, :64] @ w.t(), rtol=1e-5, atol=1e-5)
    assert k.router.gate_partials(torch.zeros(0, 64), w).shape == (2, 0, 16)
    with pytest.raises(ValueError, match="share H"):
        k.router.gate_partials(x, w)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        k.router.gate_partials(x[:, :64].double(), w)


def test_router_empty_batch(k):
    ids, weights = k.route_logits(torch.zeros(0, 64), None, top_k=8, n_group=8, topk_group=4,
                                  routed_scaling_factor=1.0)
    assert ids.shape == (0, 8) and weights.shape == (0, 8)


@pytest.mark.parametrize("experts,n_group,topk_group,top_k", [(60, 8, 4, 8), (8, 8, 4, 2), (64, 8, 0, 8),
                                                               (64, 8, 4, 33), (8, 1, 1, 9)])
def test_router_rejects_impossible_shapes(k, experts, n_group, topk_group, top_k):
    with pytest.raises(ValueError):
        k.route_logits(torch.zeros(2, experts), None, top_k=top_k, n_group=n_group, topk_group=topk_group,
                       routed_scaling_factor=1.0)


def test_router_rejects_non_fp32_logits(k):
    with pytest.raises(TypeError):
        k.route_logits(torch.zeros(2, 64, dtype=torch.bfloat16), None, top_k=8, n_group=8, topk_group=4,
                       routed_scaling_factor=1.0)


# ---------------------------------------------------------------------------------------------------------------
# confidence


def exact_confidence(logits, x0):
    """softmax(logits)[x0] in fp64: the truth both fp32 implementations approximate."""
    return torch.softmax(logits.double(), dim=-1).gather(1, x0[:, None]).squeeze(1)


def assert_same_prediction(got, logits):
    x0, prob = got
    ref_x0, ref_prob = predict_reference(logits, 0.0, None)
    assert x0.dtype == torch.int64 and prob.dtype == torch.float32
    assert torch.equal(x0, ref_x0)
    # torch's sequential CPU sum of 40,000 terms is off the truth by up to 1.2e-5 relative on an AMD EPYC host
    # (its vectorised code differs by CPU); the kernel's is within 1e-6 of it (checked next)
    torch.testing.assert_close(prob, ref_prob, rtol=2e-5, atol=0, equal_nan=True)
    finite = torch.isfinite(ref_prob)
    truth = exact_confidence(logits[finite], ref_x0[finite])
    # the kernel's sums are in lanes and tiles, torch's CPU sum is sequential: the kernel is the closer one
    torch.testing.assert_close(prob[finite].double(), truth, rtol=1e-6, atol=0)


CONFIDENCE_SHAPES = [
    # rows, columns, columns a tile, programs a row (None: the launcher's plan)
    (1, 1000, None, None),         # one row, one partial tile
    (1, 1, None, None),            # one column
    (7, 4999, 256, None),          # many tiles in one program, last one partial
    (7, 4999, 256, 3),             # rows split in three, partials combined
    (33, 3001, 512, 100),          # more splits asked than tiles: one tile a program
    (4, 5000, 1024, 2),
]


@pytest.mark.parametrize("scale,offset", [(3.0, 0.0), (0.01, 0.0), (1.0, 50.0)], ids=["peaked", "flat", "offset"])
@pytest.mark.parametrize("rows,cols,block,splits", CONFIDENCE_SHAPES)
def test_confidence_matches_reference(k, rows, cols, block, splits, scale, offset):
    g = torch.Generator().manual_seed(rows * cols)
    logits = torch.randn(rows, cols, generator=g) * scale + offset
    assert_same_prediction(k.confidence(logits, block=block, splits=splits), logits)


def test_confidence_moderate_batch(k):
    """A decoding block of 32 positions over a 40k vocabulary, with the launcher's own tile and split plan."""
    logits = torch.randn(32, 40_000, generator=torch.Generator().manual_seed(1)) * 4
    assert_same_prediction(k.confidence(logits), logits)
    assert_same_prediction(k.confidence(logits, block=1024, splits=5), logits)


@pytest.mark.parametrize("block,splits", [(256, 1), (256, 4), (64, 100)])
def test_confidence_ties_go_to_the_lowest_index(k, block, splits):
    """Equal maxima in one lane (a tile apart), in different lanes, in different splits, and a constant row."""
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(2))
    for row, places in enumerate([(5, 5 + 256), (2999, 17), (2000, 900), (1500, 1499, 2900)]):
        logits[row, list(places)] = 9.0
    logits[4] = 0.25
    got = k.confidence(logits, block=block, splits=splits)
    assert got[0].tolist() == [5, 17, 900, 1499, 0]
    assert_same_prediction(got, logits)


def test_confidence_argmax_of_logits_not_of_rounded_probabilities(k):
    """The documented difference: logits 1e-8 apart round to the same probability; the reference's argmax of the
    probabilities then says 0, the kernel's argmax of the logits says 1. The confidence is the same."""
    logits = torch.tensor([[0.0, 1e-8, -5.0]])
    ref_x0, ref_prob = predict_reference(logits, 0.0, None)
    x0, prob = k.confidence(logits)
    assert ref_x0.item() == 0 and x0.item() == 1
    torch.testing.assert_close(prob, ref_prob, rtol=1e-6, atol=0)


@pytest.mark.parametrize("block,splits", [(4096, 1), (128, 3)])
def test_confidence_non_finite_rows(k, block, splits):
    """Rows with a NaN or +Inf anywhere (also after the max, in another split), only -Inf, or -Inf beside finite
    values give what the reference gives: x0 = 0 and a NaN probability, except the last, which is finite."""
    logits = torch.randn(8, 700, generator=torch.Generator().manual_seed(4))
    logits[0, 650] = math.nan
    logits[1, 3] = math.inf
    logits[2, [10, 600]] = math.inf
    logits[3] = -math.inf
    logits[4, 100], logits[4, 500] = math.nan, math.inf
    logits[5, :] = -math.inf
    logits[5, 699] = math.nan
    logits[6, 0], logits[6, 1] = 20.0, math.nan
    logits[7, ::2] = -math.inf
    x0, prob = k.confidence(logits, block=block, splits=splits)
    assert not torch.isfinite(prob[:7]).any() and torch.isfinite(prob[7])
    assert x0[:7].tolist() == [0] * 7
    assert_same_prediction((x0, prob), logits)


def test_predict_drop_in(k):
    """predict() has the reference's signature: the kernel at temperature 0, the reference's sampling above."""
    logits = torch.randn(6, 2000, generator=torch.Generator().manual_seed(5))
    assert_same_prediction(k.predict(logits, 0.0, None), logits)
    got = k.predict(logits, 0.7, torch.Generator().manual_seed(9))
    want = predict_reference(logits, 0.7, torch.Generator().manual_seed(9))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_confidence_edges(k):
    x0, prob = k.confidence(torch.zeros(0, 10))
    assert x0.shape == (0,) and prob.shape == (0,)
    with pytest.raises(TypeError):
        k.confidence(torch.zeros(2, 10, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        k.confidence(torch.zeros(2, 0))
    with pytest.raises(ValueError):
        k.confidence(torch.zeros(2, 10), block=100)
    transposed = torch.randn(50, 3).t()                                  # column stride != 1: copied first
    assert_same_prediction(k.confidence(transposed), transposed)


# ---------------------------------------------------------------------------------------------------------------
# availability and the compiled kernels


def test_available_under_the_interpreter(k):
    assert k.router.available() and k.conf.available()


def test_oled_imports_without_triton():
    """Triton is optional: with it unimportable, oled and the launcher modules import and report unavailable."""
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None          # makes `import triton` raise ImportError
        import oled
        from oled.kernels import triton_confidence, triton_router
        assert not triton_router.available() and not triton_confidence.available()
    """)
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, timeout=120)


COMPILE_SM90 = textwrap.dedent("""
    import re, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from oled.kernels.confidence_kernel import combine_kernel, scan_kernel
    from oled.kernels.moe_align_kernel import align_pairs_kernel
    from oled.kernels.moe_kernel import combine_kernel as moe_combine_kernel
    from oled.kernels.moe_kernel import down_kernel, gate_up_kernel
    from oled.kernels.norm_kernel import add_rms_norm_kernel, qk_norm_rope_kernel
    from oled.kernels.router_kernel import gate_partials_kernel, sigmoid_group_route_kernel

    def build(fn, signature, constexprs, num_warps, aligned=()):
        # `aligned`: the arguments Triton's launcher would mark divisible by 16 for the shapes that matter
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        sig = dict(signature, **{c: "constexpr" for c in constexprs})
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm

    router = build(sigmoid_group_route_kernel,
        {"logits_ptr": "*fp32", "bias_ptr": "*bf16", "ids_ptr": "*i64", "weights_ptr": "*fp32", "num_tokens": "i32",
         "logits_row_stride": "i32", "split_stride": "i32", "routed_scaling_factor": "fp32"},
        {"N_GROUP": 8, "GROUP_SIZE": 32, "TOPK_GROUP": 4, "TOP_K": 8, "BLOCK_T": 1, "BLOCK_G": 8, "BLOCK_S": 32,
         "BLOCK_K": 8, "HAS_BIAS": True, "NORMALISE": True, "PRECISE": True, "SPLITS": 16}, 1)
    assert "div.rn.f32" in router["ptx"] and "div.full" not in router["ptx"], "sigmoid must divide like torch"
    assert router["cubin"]
    # the gate GEMM of a decode step (oled/kernels/triton_router.py's compiled tiles): bf16 operands on the tensor
    # cores with fp32 accumulators, fp32 ones as FMAs (no TF32)
    gate_args = {"hidden_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*fp32", "num_tokens": "i32",
                 "num_experts": "i32", "hidden_size": "i32", "hidden_row_stride": "i32", "weight_row_stride": "i32",
                 "split_stride": "i32"}
    gate_tiles = {"BLOCK_T": 32, "BLOCK_E": 32, "BLOCK_K": 128, "K_PER_SPLIT": 128}
    gate = build(gate_partials_kernel, gate_args, dict(gate_tiles, WIDEN=False), 4)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in gate["ptx"] and gate["cubin"]
    gate = build(gate_partials_kernel, dict(gate_args, weight_ptr="*fp32"), dict(gate_tiles, WIDEN=True), 4)
    assert "mma" not in gate["ptx"] and "tf32" not in gate["ptx"] and gate["cubin"]
    parts = {"logits_ptr": "*fp32", "x0_ptr": "*i64", "prob_ptr": "*fp32", "part_max_ptr": "*fp32",
             "part_sum_ptr": "*fp32", "part_at_ptr": "*i32", "part_bad_ptr": "*i32"}
    for split in (False, True):
        scan = build(scan_kernel, dict(parts, num_cols="i32", row_stride="i32"),
                     {"TILES": 5, "BLOCK": 2048, "SPLIT": split}, 8, aligned=(*parts, "num_cols", "row_stride"))
        loads = set(re.findall(r"ld\\.global[.\\w]*", scan["ptx"]))
        assert loads == {"ld.global.v4.b32"}, loads                     # 16-byte loads of the logits
    outputs = {name: kind for name, kind in parts.items() if name != "logits_ptr"}
    combine = build(combine_kernel, dict(outputs, splits="i32"), {"BLOCK_SPLITS": 16}, 1)
    assert combine["cubin"]

    # the fused MoE at LLaDA2.0-mini's shapes with the launcher's default tiles (oled/kernels/triton_moe.py)
    # (the last: the mapped forward's, which stores the routing for the host as well)
    align_stores = {}
    # (the last: with the shared expert's pairs too)
    for lookup, mapped, capture, routing, shared in ((False, False, False, False, False),
                                                     (True, False, False, False, False),
                                                     (True, True, False, False, False),
                                                     (True, True, True, False, False),
                                                     (True, True, True, True, False), (True, True, True, True, True),
                                                     (True, True, True, True, "cpu")):
        cpu_share, shared = shared == "cpu", shared is True
        align = build(align_pairs_kernel,
            {"pair_slots_ptr": "*i64", "slot_map_ptr": "*i64", "sorted_pairs_ptr": "*i32", "block_slots_ptr": "*i32",
             "cursor_ptr": "*i32", "capture_ptr": "*i64", "block_capture_ptr": "*i32", "weights_ptr": "*fp32",
             "routing_ptr": "*i32", "cpu_table_ptr": "*i32", "x_ptr": "*bf16", "x_rows_ptr": "*bf16",
             "pair_on_cpu_ptr": "*i32", "done_ptr": "*i32", "num_pairs": "i32", "num_routed": "i32",
             "num_slots": "i32", "slot_base": "i32", "host_bin": "i32", "shared_bin": "i32", "num_blocks": "i32",
             "num_capture": "i32", "x_row_stride": "i32", "cpu_capacity": "i32"},
            {"BLOCK_M": 16, "BLOCK_P": 512, "BLOCK_S": 1024 if shared else 512 if mapped else 256,
             "BLOCK_FILL": 1024, "LOOKUP": lookup, "MAPPED": mapped, "CAPTURE": capture, "BLOCK_R": 8,
             "ROUTING": routing, "TOP_K": 8, "SHARED": shared, "CPU_SHARE": cpu_share,
             "HIDDEN": 2048 if cpu_share else 0, "BLOCK_K2": 8}, 4)
        # cursors and padding written before the pairs land; each pair's row from one relaxed atomic
        assert "bar.sync" in align["ptx"] and "atom.global.gpu.relaxed.add" in align["ptx"], align["ptx"]
        # the CPU's share: the host's mark reset by a system-scope acquire-release exchange, between the input rows
        # and the routing
        assert ("atom.global.sys.acq_rel.exch" in align["ptx"]) == cpu_share
        if not shared and not cpu_share:
            align_stores[routing] = align["ptx"].count("st.global")
    # the routing's stores (an id's two halves and its weight) only where asked for
    assert align_stores[True] > align_stores[False], align_stores
    tiles = {"HIDDEN": 2048, "INTER": 512, "BLOCK_M": 16, "BLOCK_K": 128, "INTERPRETED": False}
    blocks = {"sorted_pairs_ptr": "*i32", "block_slots_ptr": "*i32", "block_capture_ptr": "*i32"}
    stores = {}
    # ("fp8": FP8 blobs, bytes, under bf16 activations)
    for dtype, mapped, capture, shared in (("bf16", False, False, False), ("fp32", False, False, False),
                                           ("bf16", True, False, False), ("bf16", True, True, False),
                                           ("bf16", False, False, True), ("bf16", True, True, True),
                                           ("fp8", False, False, False), ("fp8", True, True, False)):
        fp8 = dtype == "fp8"
        blob = "u8" if fp8 else dtype
        dtype = "bf16" if fp8 else dtype
        weights = dict(pool_ptr=f"*{blob}", host_ptr=f"*{blob}", shared_ptr=f"*{blob}", pool_row_stride="i32",
                       host_row_stride="i32", host_bin="i32", shared_bin="i32")
        gate_up = build(gate_up_kernel,
            dict(blocks, **weights, x_ptr=f"*{dtype}", act_ptr=f"*{dtype}", x_row_stride="i32", num_routed="i32",
                 top_k="i32"),
            dict(tiles, BLOCK_N=32, MAPPED=mapped, CAPTURE=capture, SHARED=shared, FP8=fp8), 4,
            aligned=("x_ptr", "pool_ptr", "host_ptr", "act_ptr", "x_row_stride", "pool_row_stride",
                     "host_row_stride"))
        down = build(down_kernel,
            dict(blocks, **weights, act_ptr=f"*{dtype}", out_ptr=f"*{dtype}", out_row_stride="i32"),
            dict(tiles, BLOCK_N=64, MAPPED=mapped, CAPTURE=capture, SHARED=shared, FP8=fp8), 4,
            aligned=("act_ptr", "pool_ptr", "host_ptr", "out_ptr", "pool_row_stride", "host_row_stride",
                     "out_row_stride"))
        for asm in (gate_up, down):
            # from a slot or from mapped host memory alike
            assert "cp.async.cg.shared.global" in asm["ptx"], "weight tiles stream in 16-byte async copies"
            # bf16 on the tensor cores; fp32 with input_precision="ieee" as exact FMAs, never TF32
            assert ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in asm["ptx"]) == (dtype == "bf16")
            assert "tf32" not in asm["ptx"]
            # FP8: e4m3 pairs widened to bf16 in registers (Hopper's cvt), the column scales read as fp32
            assert ("cvt.rn.bf16x2.e4m3x2" in asm["ptx"] or "cvt.rn.f16x2.e4m3x2" in asm["ptx"]) == fp8
        if mapped and not shared and not fp8:   # a capture writes the weight tiles it read into the slot: more global stores
            stores[capture] = (gate_up["ptx"].count("st.global"), down["ptx"].count("st.global"))
    assert all(c > p for c, p in zip(stores[True], stores[False])), stores
    assert "div.rn.f32" in gate_up["ptx"], "silu must divide like torch"
    for add, cpu_share in ((False, False), (True, False), (True, True)):
        moe_combine = build(moe_combine_kernel,
            {"y_ptr": "*bf16", "weights_ptr": "*fp32", "add_ptr": "*bf16", "out_ptr": "*bf16", "y_row_stride": "i32",
             "add_row_stride": "i32", "out_row_stride": "i32", "hidden": "i32", "pair_on_cpu_ptr": "*i32",
             "done_ptr": "*i32", "row_of_pair_ptr": "*i32", "cpu_rows_ptr": "*fp32", "errors_ptr": "*i32",
             "timeout_ns": "i64"},
            {"TOP_K": 8, "BLOCK_H": 1024, "HAS_ADD": add, "CPU_SHARE": cpu_share, "BLOCK_K2": 8,
             "INTERPRETED": False}, 4)
        assert "fma.rn.bf16" not in moe_combine["ptx"] and "add.rn.bf16" not in moe_combine["ptx"]
        # the wait for the host's mark: volatile loads bounded by the global timer
        assert ("%globaltimer" in moe_combine["ptx"] and "ld.volatile.global" in moe_combine["ptx"]) == cpu_share
    from oled.kernels.mlp_kernel import silu_mul_kernel
    silu_mul = build(silu_mul_kernel, {"h_ptr": "*bf16", "out_ptr": "*bf16", "h_row_stride": "i32",
                                       "out_row_stride": "i32", "inter": "i32"},
                     {"BLOCK": 512, "INTERPRETED": False}, 4)
    assert "div.rn.f32" in silu_mul["ptx"] and "mul.bf16" not in silu_mul["ptx"], "silu and product as torch's"

    # the norms at LLaDA2.0-mini's shapes (hidden 2048; 16 query and 4 KV heads of 128, 64 dims rotated)
    for residual in (False, True):
        norm = build(add_rms_norm_kernel,
            {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
             "num_rows": "i32", "n_cols": "i32", "x_stride": "i32", "residual_stride": "i32", "out_stride": "i32",
             "sum_stride": "i32", "eps": "fp32"}, {"BLOCK_R": 1, "BLOCK": 2048, "HAS_RESIDUAL": residual}, 4)
        assert "fma.rn.bf16" not in norm["ptx"] and "mul.bf16" not in norm["ptx"], "torch's roundings, one by one"
    prologue = build(qk_norm_rope_kernel,
        {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "q_stride": "i32", "k_stride": "i32", "v_stride": "i32",
         "cos_ptr": "*bf16", "sin_ptr": "*bf16", "rope_stride": "i32", "q_weight_ptr": "*bf16", "k_weight_ptr": "*bf16",
         "positions_ptr": "*i64", "q_out_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
         "q_out_head_stride": "i32", "cache_head_stride": "i32", "cache_pos_stride": "i32", "num_tokens": "i32",
         "eps": "fp32"},
        {"NUM_HEADS": 16, "NUM_KV_HEADS": 4, "HEAD_DIM": 128, "ROTARY": 64, "BLOCK_T": 1, "BLOCK_D": 128,
         "HAS_NORM": True}, 1)
    # a bf16 FMA would skip the rounding of RoPE's products (kernel_math.round_to)
    assert "fma.rn.bf16" not in prologue["ptx"] and "mul.bf16" not in prologue["ptx"]
""")


def test_kernels_compile_for_sm90(tmp_path):
    """The compiled path (never run here): the kernels lower to sm_90 PTX and cubin with Triton's bundled ptxas."""
    compile_for_sm90(COMPILE_SM90, tmp_path)


def test_bench_cases_run_under_the_interpreter(k):
    """benchmarks/kernels_bench.py's cases end to end on small shapes, with stand-ins for the CUDA timer and the
    profiler's launch count: the wiring, the checks and the record all work before the H200 sees them."""
    from tests.test_kernels_bench import load_bench

    bench = load_bench()
    timer = lambda fn, inputs: [fn(*a) for a in inputs] and 10.0                       # noqa: E731
    counter = lambda fn, args: bench.per_call(Counter({"kernel": 2}), Counter(), calls=2)   # noqa: E731
    graph_timer = lambda fn, args: fn(*args) is not None and 5.0                        # noqa: E731
    router = bench.router_case(9, device="cpu", timer=timer, counter=counter, hidden=32, experts=64,
                               graph_timer=graph_timer)
    assert router["check"]["ok"] and router["check"]["rows"] == 9 and router["speedup"] == 1.0
    assert router["check"]["near_tie_rows"] == router["check"]["mismatched_rows"] == 0
    assert router["torch_graph_us"] == router["triton_graph_us"] == router["gate_gemm_graph_us"] == 5.0
    conf = bench.confidence_case(9, device="cpu", timer=timer, counter=counter, vocab=3000, copies=2)
    assert conf["check"]["ok"] and conf["check"]["non_finite"]["ok"]
    assert conf["bytes"] == 9 * 3000 * 4 and conf["triton_gbps"] == pytest.approx(conf["bytes"] / 10e-6 / 1e9)
    assert conf["triton"]["launches"] == 1
    moe_fp8 = bench.moe_fp8_case(5, 4, 6, device="cpu", timer=timer, counter=counter, hidden=64, inter=32, top_k=2,
                                 graph_timer=graph_timer)
    assert moe_fp8["check"]["equal_fraction"] == 1.0                      # the bits of the dequantised pool's
    assert moe_fp8["fp8_bytes"] * 2 > moe_fp8["bf16_bytes"] > moe_fp8["fp8_bytes"]  # half the weights, plus scales
    json.dumps([router, conf, moe_fp8])                                                  # one JSON line each


def test_host_read_probe_gathers_the_named_blobs(monkeypatch):
    """benchmarks/host_read_probe.py's gather kernel under the interpreter: dst[b] is blob ids[b] of the store bit for
    bit, a blob longer than one program's loads spread over several programs, its tail masked."""
    from tests.scripts import benchmark_script

    monkeypatch.setenv("TRITON_INTERPRET", "1")          # read when the script's kernel is decorated
    probe = benchmark_script("host_read_probe")
    store = torch.randn(6, 1000).to(torch.bfloat16)
    ids = torch.tensor([4, 0, 4])
    dst = torch.full((3, 1000), float("nan"), dtype=torch.bfloat16)
    probe.gather_kernel[(3, triton.cdiv(1000, 128 * 2))](store, dst, ids, 1000, BLOCK=128, CHUNKS=2)
    assert torch.equal(dst, store[ids])


# ---------------------------------------------------------------------------------------------------------------
# in the engine

def test_fused_router_in_the_engine_gives_the_same_tokens_and_routing(k, monkeypatch):
    """--fused-router: the MoE layers route with the kernel; the tokens and every layer's routing statistics are
    those of the torch router (fp32, a random tiny model, an offloaded budget)."""
    import oled
    from oled.decoding.params import DecodeParams

    launches = []
    kernel_gate = k.router.gate_partials
    monkeypatch.setattr(k.router, "gate_partials", lambda *a, **kw: launches.append(1) or kernel_gate(*a, **kw))
    runs = {}
    for fused in (False, True):
        llm = oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="lru", expert_budget="0.5",
                       fused_router=fused)
        assert all(b.fused_router == fused for b in llm.engine.model.moe_blocks())
        ids = llm.tokenizer.encode("def fib(n):\n")
        res = llm.engine.generate_ids(ids, DecodeParams(gen_length=16, block_length=16))
        runs[fused] = (res.token_ids, [{k_: v for k_, v in r.items() if k_ not in ("cpu_s", "cpu_s_model")}
                                       for r in llm.engine.manager.stats.to_rows()])
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 16
    assert runs[True][1] == runs[False][1]
    assert len(launches) == len(runs[True][1])          # one gate per MoE layer per forward, only when fused


def test_fused_router_refuses_a_softmax_router(k):
    import oled

    with pytest.raises(ValueError, match="implements LLaDA2's sigmoid group routing"):
        oled.LLM(random_weights="tiny-lladamoe", device="cpu", dtype="float32", fused_router=True)
