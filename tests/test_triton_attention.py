"""The attention kernel (oled/kernels/triton_attention.py) on the CPU through Triton's interpreter, against what it
replaces: the model's additive mask (MoEDiffusionLM.attention_mask) and torch's scaled_dot_product_attention with
the output transposed for o_proj; and the engine's tokens unchanged with --fused-attention."""
from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from oled.models.model import MoEDiffusionLM
from tests.triton_interpreter import compile_for_sm90, import_triton_for_the_interpreter, interpreted_kernels

triton = import_triton_for_the_interpreter()


@pytest.fixture(scope="module")
def kernel():
    mp = interpreted_kernels("kernel_math", "attention_kernel")
    from oled.kernels import attention_kernel, triton_attention, triton_support

    assert triton_support.interpreted(attention_kernel.attention_kernel)
    yield triton_attention.attention
    mp.undo()


def _reference(q, k_cache, v_cache, key_len, positions, kv_end, block_length):
    """Attention.forward's torch path: the model's mask, SDPA over cache[:key_len], [T, heads * D]."""
    heads, T, D = q.shape
    model = SimpleNamespace(config=SimpleNamespace(block_causal=block_length is not None),
                            embed=SimpleNamespace(weight=torch.empty(0, dtype=q.dtype)))
    mask = MoEDiffusionLM.attention_mask(model, positions, kv_end, key_len, block_length or 1)
    out = F.scaled_dot_product_attention(q.unsqueeze(0), k_cache[:, :key_len].unsqueeze(0),
                                         v_cache[:, :key_len].unsqueeze(0), attn_mask=mask,
                                         enable_gqa=heads != k_cache.shape[0])
    return out.squeeze(0).transpose(0, 1).reshape(T, heads * D)


def _case(heads, kv_heads, D, T, start, max_len, dtype, seed):
    """Queries as the prologue leaves them (a transposed [T, heads, D] view), caches of max_len positions."""
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(T, heads, D, generator=g)).to(dtype).transpose(0, 1)
    k_cache = torch.randn(kv_heads, max_len, D, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, max_len, D, generator=g).to(dtype)
    return q, k_cache, v_cache, torch.arange(start, start + T)


# (heads, kv_heads, head_dim, tokens, start, kv_end, key_len, block_length): decode chunks at the cache's end and
# inside it, keys past kv_end (a graph's bucket padding), GQA groups of 1 to 4 (3: a group that fills part of its
# power of two), a head_dim narrower than its block (24), a single token, a prefill-like chunk, not block-causal
CASES = [(4, 1, 16, 8, 40, 48, 64, 8), (4, 2, 32, 5, 11, 16, 40, 4), (2, 2, 24, 1, 70, 71, 71, 16),
         (3, 1, 16, 12, 0, 12, 12, 4), (4, 2, 16, 6, 20, 26, 48, None), (8, 2, 64, 33, 0, 33, 96, 32)]


@pytest.mark.parametrize("heads,kv_heads,D,T,start,kv_end,key_len,block_length", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_equals_the_mask_and_sdpa(kernel, heads, kv_heads, D, T, start, kv_end, key_len, block_length,
                                            dtype):
    q, k_cache, v_cache, positions = _case(heads, kv_heads, D, T, start, key_len + 8, dtype, seed=T * D + heads)
    end = torch.tensor(kv_end)
    out = kernel(q, k_cache, v_cache, key_len, positions, end, block_length)
    ref = _reference(q.float(), k_cache.float(), v_cache.float(), key_len, positions, end, block_length)
    assert out.dtype == dtype and out.shape == (T, heads * D)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    else:
        # bf16 inputs, fp32 sums; the probabilities rounded to bf16 before P @ V and the output to bf16: a few ulps
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
        assert (out.float() - ref).abs().mean() < 4e-3
        ref_bf16 = _reference(q, k_cache, v_cache, key_len, positions, end, block_length)
        torch.testing.assert_close(out.float(), ref_bf16.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("rows,block_n,splits", [(16, 16, 1), (16, 64, 1), (64, 32, 1), (128, 64, 1), (16, 8, 2),
                                                  (16, 8, 3), (32, 16, 4), (16, 8, 8)])
def test_any_tiles_give_the_reference(kernel, rows, block_n, splits):
    """The compiled defaults differ from the interpreter's (programs of 16 rows for a decode chunk, 128 for a
    prefill, keys split over several programs): whatever the rows a program takes, the keys a tile holds and the
    programs a row's keys are split over, the result is the mask and SDPA's, a group of 3 heads filling part of its
    power of two and a chunk that spans two blocks included. With 8 splits of tiles of 8 keys, the rows of the first
    block (keys < 32) leave the last splits nothing to walk: empty splits weigh nothing."""
    from oled.kernels.triton_attention import AttentionTiles

    q, k_cache, v_cache, positions = _case(6, 2, 32, 12, 26, 48, torch.float32, seed=rows + block_n + splits)
    end = torch.tensor(38)
    tiles = AttentionTiles(rows=rows, block_n=block_n, warps=1, stages=1, splits=splits)
    out = kernel(q, k_cache, v_cache, 40, positions, end, 8, tiles=tiles)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, 40, positions, end, 8), rtol=2e-6, atol=2e-6)


def test_split_keys_in_bf16_agree_with_one_pass(kernel):
    """bf16, keys split over 4 programs: within the unsplit kernel's distance of the fp32 reference (each split's
    probabilities are rounded against its own running max), every call alike, and a query that sees no key still
    gets zeros."""
    from oled.kernels.triton_attention import AttentionTiles

    q, k_cache, v_cache, positions = _case(8, 2, 32, 8, 40, 56, torch.bfloat16, seed=11)
    end = torch.tensor(48)
    split = AttentionTiles(rows=16, block_n=8, warps=1, stages=1, splits=4)
    one = split._replace(splits=1)
    ref = _reference(q.float(), k_cache.float(), v_cache.float(), 48, positions, end, 8)
    got, unsplit = kernel(q, k_cache, v_cache, 48, positions, end, 8, tiles=split), \
        kernel(q, k_cache, v_cache, 48, positions, end, 8, tiles=one)
    assert torch.equal(got, kernel(q, k_cache, v_cache, 48, positions, end, 8, tiles=split))
    assert (got.float() - ref).abs().max() <= 2 * (unsplit.float() - ref).abs().max() + 1e-2
    assert (got.float() - ref).abs().mean() < 4e-3
    nothing = kernel(q, k_cache, v_cache, 48, positions, torch.tensor(0), 8, tiles=split)
    assert torch.equal(nothing, torch.zeros_like(nothing))


def test_auto_splits_fill_the_multiprocessors_once(monkeypatch):
    """A decode chunk of LLaDA2.0-mini (32 programs) on 132 multiprocessors: 4 splits; a block's first forward (64
    programs): 2; a prefill: 1; never more splits than key tiles, nor than MAX_SPLITS; interpreted: 1."""
    from oled.kernels import triton_attention as ta

    monkeypatch.setattr(ta, "multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert ta.auto_splits(32, 512, 64, cuda, interpreting=False) == 4
    assert ta.auto_splits(64, 512, 64, cuda, interpreting=False) == 2
    assert ta.auto_splits(260, 512, 64, cuda, interpreting=False) == 1
    assert ta.auto_splits(32, 100, 64, cuda, interpreting=False) == 2
    assert ta.auto_splits(4, 4096, 64, cuda, interpreting=False) == ta.MAX_SPLITS
    assert ta.auto_splits(32, 0, 64, cuda, interpreting=False) == 1
    assert ta.auto_splits(32, 512, 64, cuda, interpreting=True) == 1


def test_the_compiled_tiles_give_a_decode_chunk_many_programs():
    """LLaDA2.0-mini's decode chunk (32 tokens x 4 query heads a KV head) in programs of 16 rows: 8 a KV head, each
    4 tokens of the group's 4 heads; a prefill of 2,048 rows a KV head in programs of 128."""
    from oled.kernels.triton_attention import _block_t, default_tiles

    decode = default_tiles(32 * 4, interpreting=False)
    assert (decode.rows, _block_t(decode.rows, 32, 4)) == (16, 4)
    assert default_tiles(512 * 4, interpreting=False).rows == 128
    assert _block_t(16, 32, 3) == 4 and _block_t(16, 2, 1) == 16 and _block_t(128, 3, 4) == 4


def test_the_keys_past_kv_end_are_never_read(kernel):
    """NaN in the cache past kv_end (a bucket's padding, stale positions) leaves the output untouched, and a new
    kv_end in the same tensor (a graph's replay) moves the visible range. (SDPA's output is NaN there: it multiplies
    the masked keys' zero probabilities by their values.)"""
    from oled.kernels.triton_attention import AttentionTiles

    split = AttentionTiles(rows=16, block_n=8, warps=1, stages=1, splits=3)
    q, k_cache, v_cache, positions = _case(4, 2, 16, 4, 20, 64, torch.float32, seed=3)
    end = torch.tensor(24)
    clean = kernel(q, k_cache, v_cache, 64, positions, end, 4)
    clean_split = kernel(q, k_cache, v_cache, 64, positions, end, 4, tiles=split)
    before = _reference(q, k_cache, v_cache, 64, positions, torch.tensor(20), None)
    k_cache[:, 24:], v_cache[:, 24:] = float("nan"), float("nan")
    assert torch.equal(kernel(q, k_cache, v_cache, 64, positions, end, 4), clean)
    assert torch.equal(kernel(q, k_cache, v_cache, 64, positions, end, 4, tiles=split), clean_split)
    end.fill_(20)                                      # the chunk sees only the keys before it: its own are hidden
    torch.testing.assert_close(kernel(q, k_cache, v_cache, 64, positions, end, None), before, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(kernel(q, k_cache, v_cache, 64, positions, end, None, tiles=split), before,
                               rtol=2e-6, atol=2e-6)


def test_a_query_that_sees_no_key_gets_zeros(kernel):
    q, k_cache, v_cache, positions = _case(2, 1, 16, 3, 0, 16, torch.float32, seed=5)
    out = kernel(q, k_cache, v_cache, 16, positions, torch.tensor(0), 4)
    assert torch.equal(out, torch.zeros(3, 32))


def test_attention_refuses_what_it_cannot_run(kernel):
    q, k_cache, v_cache, positions = _case(4, 2, 16, 4, 0, 16, torch.float32, seed=7)
    end = torch.tensor(4)
    with pytest.raises(ValueError, match="shapes do not fit"):
        kernel(q, k_cache[:1], v_cache, 16, positions, end, 4)
    with pytest.raises(ValueError, match="shapes do not fit"):
        kernel(q[:3], k_cache, v_cache, 16, positions, end, 4)          # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="key_len"):
        kernel(q, k_cache, v_cache, 17, positions, end, 4)
    with pytest.raises(TypeError, match="share one of"):
        kernel(q.to(torch.bfloat16), k_cache, v_cache, 16, positions, end, 4)
    with pytest.raises(TypeError, match="integer"):
        kernel(q, k_cache, v_cache, 16, positions.float(), end, 4)


@pytest.mark.parametrize("preset,policy,budget,splits", [("tiny", "full", "1.0", None), ("tiny", "oled", "0.5", None),
                                                         ("tiny-lladamoe", "lru", "0.5", None),
                                                         ("tiny", "full", "1.0", 3)])
def test_fused_attention_in_the_engine_gives_the_same_tokens(kernel, monkeypatch, preset, policy, budget, splits):
    """--fused-attention: every layer's attention runs the kernel and no mask is built; the tokens are those of the
    mask and SDPA (fp32, random tiny models of both architectures: block-causal and not, offloaded budgets; and with
    every chunk's keys split over 3 programs, as compiled decode chunks are)."""
    import oled
    from oled.decoding.params import DecodeParams
    from oled.kernels import triton_attention

    if splits:
        monkeypatch.setattr(triton_attention, "auto_splits", lambda *a, **kw: splits)
    calls = []
    monkeypatch.setattr(triton_attention, "attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    masks = []
    build = MoEDiffusionLM.attention_mask
    monkeypatch.setattr(MoEDiffusionLM, "attention_mask", lambda *a, **kw: masks.append(1) or build(*a, **kw))
    tokens = {}
    for fused in (False, True):
        calls.clear()
        masks.clear()
        llm = oled.LLM(random_weights=preset, device="cpu", dtype="float32", policy=policy, expert_budget=budget,
                       fused_attention=fused)
        res = llm.engine.generate_ids(llm.tokenizer.encode("def fib(n):\n"), DecodeParams(gen_length=16,
                                                                                           block_length=8))
        tokens[fused] = res.token_ids
        forwards = res.nfe + res.cache_forwards
        assert len(calls) == (forwards * llm.engine.config.num_layers if fused else 0)
        assert len(masks) == (0 if fused else forwards)
    assert tokens[True] == tokens[False] and len(tokens[True]) == 16


def test_the_benchmarks_attention_case_runs_under_the_interpreter(kernel):
    """benchmarks/kernels_bench.py's attention case end to end on small heads, with stand-ins for the CUDA timer and
    the launch counter: its reference, check and record work before the H200 sees them."""
    from collections import Counter

    from tests.test_kernels_bench import load_bench

    bench = load_bench()
    timer = lambda fn, inputs: [fn(*a) for a in inputs] and 10.0                       # noqa: E731
    counter = lambda fn, args: bench.per_call(Counter({"kernel": 1}), Counter(), calls=1)   # noqa: E731
    graph_timer = lambda fn, args: fn(*args) is not None and 5.0                        # noqa: E731
    record = bench.attention_case(8, 24, 32, 48, device="cpu", timer=timer, counter=counter, heads=4, kv_heads=2,
                                  head_dim=16, block_length=8, graph_timer=graph_timer)
    assert record["check"]["ok"], record
    assert record["speedup"] == 1.0 and set(record["torch"]) == set(record["triton"])
    assert record["torch_graph_us"] == record["triton_graph_us"] == 5.0 and record["tiles"] == "default"
    assert record["kv_gbps"] == pytest.approx(2 * 2 * 32 * 16 * 2 / 5e-6 / 1e9)      # K and V up to kv_end, bf16


COMPILE_SM90 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from oled.kernels.attention_kernel import attention_kernel, combine_splits_kernel

    def build(fn, signature, constexprs, num_warps):
        sig = dict(signature, **{c: "constexpr" for c in constexprs})
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm

    ints = ("q_head_stride", "q_token_stride", "cache_head_stride", "cache_pos_stride", "out_stride", "num_tokens",
            "num_heads", "key_len", "block_length")
    args = dict({name: "*bf16" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")},
                part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", positions_ptr="*i64",
                kv_end_ptr="*i64", qk_scale="fp32", **{name: "i32" for name in ints})
    # LLaDA2.0-mini's decode chunk: 4 query heads a KV head, head_dim 128, programs of 16 rows, keys split or not
    for splits in (1, 4):
        asm = build(attention_kernel, args, {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_T": 4, "BLOCK_G": 4, "BLOCK_N": 64,
                                             "BLOCK_D": 128, "BLOCK_CAUSAL": True, "SPLITS": splits,
                                             "INTERPRETED": False}, 4)
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in asm["ptx"] and asm["cubin"]
    combine = build(combine_splits_kernel,
                    {"part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "out_ptr": "*bf16",
                     "num_tokens": "i32", "num_heads": "i32", "out_stride": "i32"},
                    {"HEAD_DIM": 128, "BLOCK_H": 16, "BLOCK_D": 128, "SPLITS": 4, "INTERPRETED": False}, 4)
    assert combine["cubin"]
""")


def test_the_attention_kernels_compile_for_sm90(tmp_path):
    """The compiled path (never run here): both kernels, split and not, lower to sm_90 PTX and cubin with Triton's
    bundled ptxas, the products on the tensor cores."""
    compile_for_sm90(COMPILE_SM90, tmp_path)
