"""The skinny GEMM (oled/kernels/triton_linear.py) on the CPU through Triton's interpreter, against F.linear and the
exact (fp64) sums of the same inputs; the engine's tokens unchanged with --fused-linear; and its sm_90 compile."""
from __future__ import annotations

import textwrap
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import compile_for_sm90, import_triton_for_the_interpreter, interpreted_kernels

triton = import_triton_for_the_interpreter()


@pytest.fixture(scope="module")
def lin():
    mp = interpreted_kernels("kernel_math", "linear_kernel")
    from oled.kernels import linear_kernel, triton_linear, triton_support

    assert triton_support.interpreted(linear_kernel.skinny_linear_kernel)
    yield triton_linear
    mp.undo()


def _operands(rows, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)


def _exact(x, w):
    """The sums of the exact products, in fp64 (exact for these sizes up to fp64's rounding), and a bound on how far
    any fp32 summation order can land from them: k * 2**-24 * sum |x_i w_i| (Higham's gamma_k)."""
    x, w = x.double(), w.double()
    return x @ w.T, x.shape[1] * 2.0**-24 * (x.abs() @ w.abs().T)


def _ulp(values, dtype):
    """The spacing of dtype's numbers at each value: eps * 2**floor(log2 |v|)."""
    _, exponent = torch.frexp(values)
    return torch.ldexp(torch.full_like(values, torch.finfo(dtype).eps), exponent - 1)


# (rows, features, reduction): rows of a decode step and ragged ones (1, 5, 17, 32, 64; 100 in two row blocks);
# features and reduction dims not multiples of the interpreter's tiles (16 and 32), or smaller than one
SHAPES = [(1, 16, 16), (5, 40, 70), (17, 100, 96), (32, 64, 128), (64, 48, 40), (100, 33, 50), (3, 7, 9)]


@pytest.mark.parametrize("rows,n,k", SHAPES)
def test_fp32_equals_f_linear(lin, rows, n, k):
    x, w = _operands(rows, n, k, torch.float32, rows * n + k)
    got = lin.linear(x, w)
    want = F.linear(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32 and got.is_contiguous()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    exact, order_bound = _exact(x, w)
    assert ((got.double() - exact).abs() <= order_bound).all()        # an fp32 sum of the exact products


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n,k", SHAPES)
def test_half_precision_is_the_fp32_sum_rounded_once(lin, dtype, rows, n, k):
    """Each element within one ulp of the output dtype of the exact sum (beyond it only by what the fp32 sum's order
    can add where the sum cancels), and the share of elements that differ from F.linear's small."""
    x, w = _operands(rows, n, k, dtype, rows * n + k)
    got = lin.linear(x, w)
    assert got.shape == (rows, n) and got.dtype == dtype
    exact, order_bound = _exact(x, w)
    assert ((got.double() - exact).abs() <= _ulp(exact, dtype) + order_bound).all()
    differ = (got != F.linear(x, w)).float().mean().item()
    assert differ <= 0.01, f"{differ:.2%} of the elements differ from F.linear's"


def test_a_sum_rounded_twice_would_fail_the_one_ulp_check(lin):
    """The check above can fail: the products rounded to bf16 before the sum (what a kernel multiplying in bf16
    would give) land more than an ulp from the exact sum somewhere."""
    x, w = _operands(32, 64, 128, torch.bfloat16, 0)
    rounded_products = (x.float()[:, None, :] * w.float()[None, :, :]).to(torch.bfloat16).float().sum(-1)
    exact, order_bound = _exact(x, w)
    assert ((rounded_products.to(torch.bfloat16).double() - exact).abs() > _ulp(exact, torch.bfloat16)
            + order_bound).any()


def test_strided_rows_give_the_contiguous_bits(lin):
    wide = torch.randn(12, 2 * 48, generator=torch.Generator().manual_seed(3)).bfloat16()
    w = torch.randn(40, 48, generator=torch.Generator().manual_seed(4)).bfloat16()
    for x in (wide[:, :48], wide[:, 48:], wide[::3, 5:53]):           # rows of a wider tensor, every third row
        assert x.stride(0) != x.shape[1]
        assert torch.equal(lin.linear(x, w), lin.linear(x.contiguous(), w))


def test_two_calls_give_the_same_bits(lin):
    x, w = _operands(17, 100, 96, torch.bfloat16, 5)
    first, second = lin.linear(x, w), lin.linear(x, w)
    assert first.data_ptr() != second.data_ptr() and torch.equal(first, second)


def test_no_rows_or_no_features_give_empty_outputs(lin):
    w = torch.randn(24, 32)
    out = lin.linear(torch.randn(0, 32), w)
    assert out.shape == (0, 24) and out.dtype == torch.float32
    assert lin.linear(torch.randn(5, 32).bfloat16(), torch.randn(0, 32).bfloat16()).shape == (5, 0)


def test_any_tiles_give_the_same_result(lin):
    """Other tiles change only the fp32 sums' order (block_k) and which program computes what."""
    x, w = _operands(20, 70, 100, torch.float32, 6)
    want = F.linear(x, w)
    for tiles in (lin.LinearTiles(16, 16, 1, 1), lin.LinearTiles(32, 64, 2, 1), lin.LinearTiles(64, 128, 4, 1)):
        torch.testing.assert_close(lin.linear(x, w, tiles=tiles), want, rtol=1e-5, atol=1e-5)


def test_linear_refuses_what_it_cannot_run(lin):
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    with pytest.raises(ValueError, match="must share K"):
        lin.linear(x, torch.randn(8, 16))
    with pytest.raises(ValueError, match="must share K"):
        lin.linear(x[0], w)
    with pytest.raises(TypeError, match="must share one of"):
        lin.linear(x, w.bfloat16())
    with pytest.raises(TypeError, match="must share one of"):
        lin.linear(x.double(), w.double())
    with pytest.raises(ValueError, match="contiguous along K"):
        lin.linear(torch.randn(32, 4).T, w)
    with pytest.raises(ValueError, match="weight contiguous"):
        lin.linear(x, torch.randn(32, 8).T)
    with pytest.raises(ValueError, match="at least 16"):
        lin.linear(x, w, tiles=lin.LinearTiles(8, 32, 1, 1))


def test_the_compiled_tiles_spread_llada2_minis_weights(lin):
    """A decode step's GEMM over LLaDA2.0-mini's weights: at least 64 programs (the H200 has 132 multiprocessors),
    128 for the 2,048-feature ones, whole tiles of K."""
    for n, k in ((3072, 2048), (2048, 2048), (1024, 2048), (2048, 512), (10240, 2048), (2048, 5120)):
        for rows in (32, 64):
            tiles = lin.default_tiles(rows, n, k, interpreting=False)
            programs = triton.cdiv(n, tiles.block_n)
            assert programs >= 64 and (programs == 128 or n != 2048) and k % tiles.block_k == 0, (n, k, tiles)


def test_the_model_takes_the_kernel_for_a_decode_step_only(lin, monkeypatch):
    """layers.linear: the kernel for a 2-D x of up to MAX_ROWS rows when asked; F.linear for more rows, for other
    ranks and when not asked."""
    from oled.models.layers import linear

    rows = []
    inner = lin.linear
    monkeypatch.setattr(lin, "linear", lambda x, w, **kw: rows.append(x.shape[0]) or inner(x, w, **kw))
    w = torch.randn(16, 32)
    for m in (1, lin.MAX_ROWS, lin.MAX_ROWS + 1):
        x = torch.randn(m, 32)
        torch.testing.assert_close(linear(x, w, skinny=True), F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert torch.equal(linear(x, w, skinny=False), F.linear(x, w))
    linear(torch.randn(2, 3, 32), w, skinny=True)
    assert rows == [1, lin.MAX_ROWS]


@pytest.mark.parametrize("preset,policy,budget,fused_mlp,prompt", [
    ("tiny", "full", "1.0", False, 1),         # LLaDA2: fused QKV, a dense layer, shared experts; gate and up apart
    ("tiny", "oled", "0.5", True, 7),          # gate|up stacked; an 84-token prefill, past MAX_ROWS
    ("tiny-lladamoe", "lru", "0.5", False, 1),  # separate Q, K and V projections, no shared expert
])
def test_fused_linear_in_the_engine_gives_the_same_tokens(lin, monkeypatch, preset, policy, budget, fused_mlp, prompt):
    """--fused-linear: every attention and SwiGLU GEMM of a forward of up to MAX_ROWS rows runs the kernel, a longer
    forward (a prefill) F.linear; the tokens are those of F.linear everywhere (fp32, random tiny models of both
    architectures, offloaded budgets)."""
    import oled
    from oled.decoding.params import DecodeParams
    from oled.models.layers import SwiGLU
    from oled.models.model import MoEDiffusionLM

    calls = []
    inner = lin.linear
    monkeypatch.setattr(lin, "linear", lambda x, w, **kw: calls.append(x.shape[0]) or inner(x, w, **kw))
    forwards = []
    run = MoEDiffusionLM.run
    monkeypatch.setattr(MoEDiffusionLM, "run", lambda self, ids, *a, **kw: forwards.append(ids.shape[0])
                        or run(self, ids, *a, **kw))
    tokens = {}
    for fused in (False, True):
        calls.clear()
        forwards.clear()
        llm = oled.LLM(random_weights=preset, device="cpu", dtype="float32", policy=policy, expert_budget=budget,
                       fused_linear=fused, fused_mlp=fused_mlp)
        res = llm.engine.generate_ids(llm.tokenizer.encode("def fib(n):\n" * prompt),
                                      DecodeParams(gen_length=16, block_length=16))
        tokens[fused] = res.token_ids
        model = llm.engine.model
        assert len(forwards) == res.nfe + res.cache_forwards
        gemms = sum(2 if hasattr(layer.attn, "qkv") else 4 for layer in model.layers)
        gemms += sum(2 if m.gate_up is not None else 3 for m in model.modules() if isinstance(m, SwiGLU))
        decode = sum(rows <= lin.MAX_ROWS for rows in forwards)
        assert len(calls) == (gemms * decode if fused else 0) and all(rows <= lin.MAX_ROWS for rows in calls)
        assert (max(forwards) > lin.MAX_ROWS) == (prompt > 1)
    assert tokens[True] == tokens[False] and len(tokens[True]) == 16


def test_the_benchmarks_linear_case_runs_under_the_interpreter(lin):
    """benchmarks/kernels_bench.py's linear case end to end on a small weight, with stand-ins for the CUDA timers
    and the launch counter: its reference, checks and record work before the H200 sees them."""
    from tests.test_kernels_bench import load_bench

    bench = load_bench()
    timer = lambda fn, inputs: [fn(*a) for a in inputs] and 10.0                       # noqa: E731
    counter = lambda fn, args: bench.per_call(Counter({"kernel": 1}), Counter(), calls=1)   # noqa: E731
    graph_timer = lambda fn, args: fn(*args) is not None and 6.0                        # noqa: E731
    record = bench.linear_case(32, 48, 80, device="cpu", timer=timer, counter=counter, graph_timer=graph_timer,
                               copies=2, name="small")
    assert record["check"]["ok"], record
    assert record["check"]["deterministic"] and record["check"]["triton"]["max_abs_err"] > 0
    assert record["weight_bytes"] == 48 * 80 * 2 and record["triton_graph_us"] == 3.0 and record["speedup"] == 1.0
    assert record["triton_graph_gbps"] == pytest.approx(48 * 80 * 2 / 3e-6 / 1e9)
    assert record["tiles"] == lin.default_tiles(32, 48, 80, interpreting=True)._asdict() and record["default_tiles"]
    tiles = bench.linear_tiles({"block_n": 32}, 32, 48, 80)
    other = bench.linear_case(5, 48, 80, device="cpu", timer=timer, counter=counter, tiles=tiles)
    assert other["check"]["ok"] and other["tiles"]["block_n"] == 32 and not other["default_tiles"]


COMPILE_SM90 = textwrap.dedent("""
    import re, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from oled.kernels.linear_kernel import skinny_linear_kernel as kernel
    from oled.kernels.triton_linear import _block_m, default_tiles

    def build(dtype, rows, n, k):
        # the launcher's compiled tiles; the arguments Triton's launcher marks divisible by 16 at these shapes
        tiles = default_tiles(rows, n, k, interpreting=False)
        constexprs = {"K": k, "BLOCK_M": _block_m(rows), "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
                      "INTERPRETED": False}
        signature = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "num_rows": "i32",
                     "num_features": "i32", "x_row_stride": "i32", "out_row_stride": "i32",
                     **{c: "constexpr" for c in constexprs}}
        aligned = ("x_ptr", "w_ptr", "out_ptr", "num_features", "x_row_stride", "out_row_stride")
        attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": tiles.warps, "num_stages": tiles.stages})

    # LLaDA2.0-mini's weights at a decode step's rows
    for n, k in ((3072, 2048), (2048, 2048), (1024, 2048), (2048, 512), (10240, 2048), (2048, 5120)):
        for rows in (32, 64):
            compiled = build("bf16", rows, n, k)
            ptx = compiled.asm["ptx"]
            # the weight and x tiles stream into shared memory in 16-byte async copies, pipelined
            assert re.search(r"cp\\.async\\.cg\\.shared\\.global \\[[^]]*\\], \\[[^]]*\\], 0x10", ptx), (n, k, rows)
            # bf16 on the tensor cores (mma.sync for 32 rows, wgmma for 64) with fp32 accumulators
            assert re.search(r"mma[.\\w]*\\.f32\\.bf16\\.bf16", ptx) and "tf32" not in ptx, (n, k, rows)
            assert compiled.metadata.shared <= 227 * 1024 and compiled.asm["cubin"], compiled.metadata.shared
    fp32 = build("fp32", 32, 2048, 2048).asm["ptx"]
    assert "mma" not in fp32 and "tf32" not in fp32, "fp32 operands multiply as exact FMAs, never TF32"
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in build("fp16", 5, 2048, 2048).asm["ptx"]
""")


def test_the_linear_kernel_compiles_for_sm90(tmp_path):
    """The compiled path (never run here): the kernel lowers to sm_90 PTX and cubin with Triton's bundled ptxas at
    LLaDA2.0-mini's shapes, its tiles streamed in async copies, the products on the tensor cores."""
    compile_for_sm90(COMPILE_SM90, tmp_path)
