"""The norm kernels (oled/kernels/triton_norm.py) on the CPU through Triton's interpreter, against the torch code they
replace: RMSNorm with the residual add before it, QK-norm + partial RoPE + the KV-cache write; and the engine's
tokens unchanged with --fused-norm."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from oled.models.layers import RMSNorm, apply_rope, rope_cos_sin
from tests.triton_interpreter import import_triton_for_the_interpreter, interpreted_kernels

triton = import_triton_for_the_interpreter()


@pytest.fixture(scope="module")
def norm():
    mp = interpreted_kernels("kernel_math", "norm_kernel", "mlp_kernel")
    from oled.kernels import norm_kernel, triton_mlp, triton_norm, triton_support

    assert triton_support.interpreted(norm_kernel.add_rms_norm_kernel)
    yield SimpleNamespace(add_rms_norm=triton_norm.add_rms_norm, qk_norm_rope=triton_norm.qk_norm_rope,
                          silu_mul=triton_mlp.silu_mul)
    mp.undo()


def _norm_module(dim, dtype, seed):
    m = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        m.weight.copy_(1 + 0.3 * torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return m.to(dtype)


def _last_bit_share(a, b):
    """Share of elements that differ; where they do, by how many ulps of the storage dtype at most."""
    diff = a != b
    return diff.float().mean().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 96), (33, 256)])      # 96: a row narrower than its block
def test_add_rms_norm_equals_the_residual_add_then_rmsnorm(norm, dtype, rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    x = (3 * torch.randn(rows, cols, generator=g)).to(dtype)
    residual = torch.randn(rows, cols, generator=g).to(dtype)
    module = _norm_module(cols, dtype, rows)
    total_ref = residual + x
    out_ref = module(total_ref)
    out, total = norm.add_rms_norm(x, residual, module.weight.data, module.eps)
    assert torch.equal(total, total_ref)                   # the add is torch's, rounding included
    assert out.dtype == dtype and out.shape == (rows, cols)
    if dtype == torch.float32:
        torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
    else:
        # one bf16 rounding of the same fp32 value: equal but where the mean's summation order moves it across a
        # rounding boundary, and then by one ulp (2**-7 relative)
        assert _last_bit_share(out, out_ref) < 0.01
        torch.testing.assert_close(out.float(), out_ref.float(), rtol=2**-7, atol=0)
    alone, same = norm.add_rms_norm(x, None, module.weight.data, module.eps)
    assert same is x
    torch.testing.assert_close(alone.float(), module(x).float(), rtol=1e-6 if dtype == torch.float32 else 2**-7,
                               atol=1e-6 if dtype == torch.float32 else 0)


def test_add_rms_norm_takes_a_strided_row_view(norm):
    x = torch.randn(4, 2 * 64)[:, :64]                    # rows of a wider tensor
    module = _norm_module(64, torch.float32, 0)
    out, _ = norm.add_rms_norm(x, None, module.weight.data, module.eps)
    torch.testing.assert_close(out, module(x), rtol=1e-6, atol=1e-6)


def test_add_rms_norm_rejects_mixed_dtypes(norm):
    with pytest.raises(TypeError, match="one dtype"):
        norm.add_rms_norm(torch.randn(2, 8), None, torch.ones(8, dtype=torch.bfloat16), 1e-6)


def _attention_reference(q, k, v, cos, sin, q_norm, k_norm, positions, k_cache, v_cache, heads, kv_heads, d):
    """What Attention.forward does between the QKV projection and attention (oled/models/attention.py)."""
    T = q.shape[0]
    q, k, v = q.view(T, heads, d), k.view(T, kv_heads, d), v.view(T, kv_heads, d)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache.index_copy_(1, positions, k.transpose(0, 1))
    v_cache.index_copy_(1, positions, v.transpose(0, 1))
    return q.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,rotary,qk_norm", [
    (4, 2, 16, 8, True),      # the tiny preset: GQA, half the dims rotated
    (2, 2, 24, 24, True),     # every dim rotated, a head narrower than its block
    (4, 1, 16, 8, False),     # no QK-norm
])
def test_qk_norm_rope_equals_the_attention_prologue(norm, dtype, heads, kv_heads, d, rotary, qk_norm):
    T, max_len = 7, 40
    g = torch.Generator().manual_seed(heads * d + rotary)
    qkv = (2 * torch.randn(T, (heads + 2 * kv_heads) * d, generator=g)).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)        # strided views, as the model has
    positions = torch.tensor([3, 4, 5, 9, 10, 11, 30])
    cos, sin = rope_cos_sin(positions, rotary, 600000.0, dtype)
    q_norm = _norm_module(d, dtype, 1) if qk_norm else None
    k_norm = _norm_module(d, dtype, 2) if qk_norm else None
    ref_k, ref_v = (torch.randn(kv_heads, max_len, d, generator=g).to(dtype) for _ in range(2))
    k_cache, v_cache = ref_k.clone(), ref_v.clone()
    with torch.no_grad():
        ref_q = _attention_reference(q, k, v, cos, sin, q_norm, k_norm, positions, ref_k, ref_v, heads,
                                     kv_heads, d)
    tables = rope_cos_sin(torch.arange(max_len), rotary, 600000.0, dtype)      # what the model keeps
    out = norm.qk_norm_rope(q, k, v, *tables, q_norm.weight.data if qk_norm else None,
                            k_norm.weight.data if qk_norm else None, 1e-6, positions, k_cache, v_cache)
    assert out.shape == (heads, T, d) and out.is_contiguous()
    assert torch.equal(v_cache, ref_v)                       # values are copied, every other cache row untouched
    untouched = torch.ones(max_len, dtype=torch.bool)
    untouched[positions] = False
    assert torch.equal(k_cache[:, untouched], ref_k[:, untouched])
    if dtype == torch.float32 or not qk_norm:
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(out, ref_q, **tol)
        torch.testing.assert_close(k_cache, ref_k, **tol)
    else:
        # the norm's summation order can move a value by one bf16 ulp, which RoPE's products and sum carry on
        for got, ref in ((out, ref_q), (k_cache, ref_k)):
            assert _last_bit_share(got, ref) < 0.01
            torch.testing.assert_close(got.float(), ref.float(), rtol=2**-6, atol=2**-6)


def test_qk_norm_rope_refuses_mismatched_shapes(norm):
    q, k = torch.randn(3, 32), torch.randn(3, 16)
    cos, sin = rope_cos_sin(torch.arange(3), 8, 1e4, torch.float32)
    cache = torch.zeros(1, 8, 16)
    with pytest.raises(ValueError, match="shapes do not fit"):
        norm.qk_norm_rope(q, k, torch.randn(3, 8), cos, sin, None, None, 1e-6, torch.arange(3), cache, cache.clone())


@pytest.mark.parametrize("preset,policy,budget", [("tiny", "full", "1.0"), ("tiny", "oled", "0.5"),
                                                  ("tiny-lladamoe", "lru", "0.5")])
def test_fused_norm_in_the_engine_gives_the_same_tokens(norm, monkeypatch, preset, policy, budget):
    """--fused-norm: every norm and every attention prologue runs the kernels; tokens are those of the torch path
    (fp32, random tiny models of both architectures, offloaded budgets)."""
    import oled
    from oled.decoding.params import DecodeParams
    from oled.kernels import triton_norm

    calls = []
    from oled.kernels import triton_mlp

    for module, name in ((triton_norm, "add_rms_norm"), (triton_norm, "qk_norm_rope"), (triton_mlp, "silu_mul")):
        inner = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _inner=inner, _name=name, **kw:
                            calls.append(_name) or _inner(*a, **kw))
    tokens = {}
    for fused in (False, True):
        calls.clear()
        llm = oled.LLM(random_weights=preset, device="cpu", dtype="float32", policy=policy, expert_budget=budget,
                       fused_norm=fused, fused_mlp=fused)
        ids = llm.tokenizer.encode("def fib(n):\n")
        res = llm.engine.generate_ids(ids, DecodeParams(gen_length=16, block_length=16))
        tokens[fused] = res.token_ids
        layers = llm.engine.config.num_layers
        forwards = res.nfe + res.cache_forwards
        # per forward: two norms a layer and the final one; one prologue a layer
        assert calls.count("add_rms_norm") == (forwards * (2 * layers + 1) if fused else 0)
        assert calls.count("qk_norm_rope") == (forwards * layers if fused else 0)
        mlps = sum(1 for layer in llm.engine.model.layers if not hasattr(layer.mlp, "experts") or layer.mlp.shared)
        assert calls.count("silu_mul") == (forwards * mlps if fused else 0)
    assert tokens[True] == tokens[False] and len(tokens[True]) == 16


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # -inf - -inf, masked
def test_fused_confidence_in_the_engine_gives_the_same_tokens(norm, monkeypatch):
    """--fused-confidence: every iteration's x0 and confidence come from the kernel; the tokens are the softmax
    path's (fp32, a random tiny model)."""
    import oled
    from oled.decoding.params import DecodeParams
    from tests.triton_interpreter import interpreted_kernels

    undo = interpreted_kernels("confidence_kernel")
    from oled.kernels import triton_confidence

    calls = []
    inner = triton_confidence.greedy_confidence
    monkeypatch.setattr(triton_confidence, "greedy_confidence", lambda *a, **kw: calls.append(1) or inner(*a, **kw))
    tokens = {}
    try:
        for fused in (False, True):
            calls.clear()
            llm = oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="lru", expert_budget="0.5",
                           fused_confidence=fused)
            res = llm.engine.generate_ids(llm.tokenizer.encode("def fib(n):\n"), DecodeParams(gen_length=16,
                                                                                               block_length=16))
            tokens[fused] = res.token_ids
            assert len(calls) == (res.nfe if fused else 0)
    finally:
        undo.undo()
    assert tokens[True] == tokens[False] and len(tokens[True]) == 16


def test_the_benchmarks_norm_case_runs_under_the_interpreter(norm):
    """benchmarks/kernels_bench.py's norm case end to end on a small hidden size, with stand-ins for the CUDA timer
    and the launch counter: its references, checks and record work before the H200 sees them."""
    from collections import Counter

    from tests.test_kernels_bench import load_bench
    from tests.triton_interpreter import interpreted_kernels

    undo = interpreted_kernels("moe_kernel")
    try:
        bench = load_bench()
        timer = lambda fn, inputs: [fn(*a) for a in inputs] and 10.0                       # noqa: E731
        counter = lambda fn, args: bench.per_call(Counter({"kernel": 1}), Counter(), calls=1)   # noqa: E731
        record = bench.norm_case(3, device="cpu", timer=timer, counter=counter, hidden=64)
    finally:
        undo.undo()
    assert record["check"]["ok"], record
    for name in ("add_rms_norm", "qk_norm_rope", "combine"):
        assert record[name]["check"]["ok"] and record[name]["speedup"] == 1.0


def test_the_kernels_are_on_by_default_with_cuda_only_and_follow_the_flags(norm, monkeypatch):
    """EngineConfig.fused_*: None by default, which is on with a CUDA device and Triton and torch's path elsewhere
    (here, the CPU); a True turns its kernel on (here through the interpreter), a False keeps torch's, and
    describe() names those that are on; the CLI's --fused / --no-fused set every one, --[no-]fused-X one."""
    import oled
    from oled.cli import build_parser
    from oled.cli.common import fused_fields
    from oled.config import EngineConfig
    from oled.engine import Engine
    from oled.kernels import triton_support

    names = ("fused_router", "fused_moe", "fused_norm", "fused_mlp", "fused_confidence", "fused_attention",
             "fused_linear")
    monkeypatch.setattr(triton_support, "available", lambda: True)
    on_cuda = SimpleNamespace(device=torch.device("cuda"), _check_triton_runs=lambda *a: None,
                              OPT_IN=Engine.OPT_IN, KERNELS=Engine.KERNELS)
    by_default = dict(dict.fromkeys(names, True), fused_linear=False)      # the skinny GEMM only when asked for
    assert Engine._pick_kernels(on_cuda, EngineConfig()) == by_default
    assert Engine._pick_kernels(on_cuda, EngineConfig(fused_mlp=False)) == dict(by_default, fused_mlp=False)
    assert Engine._pick_kernels(on_cuda, EngineConfig(fused_linear=True)) == dict.fromkeys(names, True)
    monkeypatch.setattr(triton_support, "available", lambda: False)          # a CUDA device without Triton
    assert Engine._pick_kernels(on_cuda, EngineConfig()) == dict.fromkeys(names, False)
    monkeypatch.undo()
    plain = oled.LLM(random_weights="tiny", device="cpu", dtype="float32")
    assert plain.engine.kernels == dict.fromkeys(names, False)
    assert "Triton kernels: none" in plain.engine.describe()
    picked = oled.LLM(random_weights="tiny", device="cpu", dtype="float32", fused_norm=True)
    assert picked.engine.kernels["fused_norm"] and not picked.engine.kernels["fused_router"]
    assert all(layer.attn.fused and layer.attn_norm.fused for layer in picked.engine.model.layers)
    assert "Triton kernels: norm" in picked.engine.describe()
    parse = build_parser()[0].parse_args
    assert fused_fields(parse(["generate", "x"])) == dict.fromkeys(names, None)
    assert fused_fields(parse(["generate", "x", "--fused"])) == dict.fromkeys(names, True)
    assert fused_fields(parse(["generate", "x", "--no-fused"])) == dict.fromkeys(names, False)
    assert fused_fields(parse(["generate", "x", "--fused-moe"])) == dict(dict.fromkeys(names, None), fused_moe=True)
    assert fused_fields(parse(["generate", "x", "--fused", "--no-fused-mlp"])) == dict(dict.fromkeys(names, True),
                                                                                      fused_mlp=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 16), (7, 48), (5, 1536)])        # 1536: two column tiles
def test_silu_mul_equals_torchs_silu_times_up(norm, dtype, rows, inter):
    """silu_mul: SiLU of the gate half times the up half, rounded where torch rounds (the SiLU, then the
    product); the interpreter's exp and division differ from torch's CPU SiLU in the last fp32 bit, which moves a
    bf16 result rarely."""
    h = (3 * torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows + inter))).to(dtype)
    want = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    got = norm.silu_mul(h)
    assert got.shape == (rows, inter) and got.dtype == dtype
    if dtype == torch.bfloat16:         # in fp32 every element may sit an fp32 ulp away: checked by the closeness
        assert _last_bit_share(got, want) < 0.01
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6 if dtype == torch.float32 else 2**-7,
                               atol=1e-6 if dtype == torch.float32 else 0)


def test_a_fused_swiglu_keeps_its_weights_once_and_its_outputs(norm):
    """SwiGLU.use_fused: gate and up become views of one stacked weight (no weight held twice) and the output
    is the torch path's (fp32)."""
    from oled.models.layers import SwiGLU

    torch.manual_seed(0)
    mlp = SwiGLU(32, 48)
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = mlp(x)
        mlp.use_fused()
        got = mlp(x)
    assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up[48:].data_ptr()
    assert sum(p.numel() for p in mlp.parameters()) == 3 * 32 * 48
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
