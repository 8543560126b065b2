"""FP8 routed experts (--expert-dtype fp8, oled/fp8.py): the quantisation round trip within e4m3's precision; the
fused MoE kernels (Triton's interpreter), the torch path and the CPU kernel on FP8 blobs against the same computation
over the dequantised weights; the store, the budget, traces and replay counting FP8 bytes; the flag's bad values; the
host-memory check of LLaDA2.0-flash; offloading with FP8 experts giving the tokens of FP8 experts all resident."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from oled import fp8, host_memory
from oled.cli import main
from oled.config import EngineConfig
from oled.decoding.params import DecodeParams
from oled.engine import Engine
from oled.models.config import config_from_dict
from oled.runtime.budget import parse_budget
from oled.runtime.cpu_kernel import CpuExpertKernel, _torch_run
from oled.runtime.grouped import grouped_swiglu
from oled.runtime.store import PARTS, ExpertStore, pinned_bytes, pinned_layer_groups
from oled.synth import preset_config
from oled.trace import Trace, record_trace, replay
from tests.costs import balanced_costs
from tests.triton_interpreter import import_triton_for_the_interpreter, interpreted_kernels

triton = import_triton_for_the_interpreter()

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]   # exp(-x) of a large -x

H, I = 64, 32                  # the tiny preset's expert shape
E4M3_HALF_ULP = 2.0**-4        # e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10   # subnormals are multiples of 2^-9: within half of that, absolutely
SENTINEL = 7.25
TINY = ["--random-weights", "tiny", "--device", "cpu", "--gen-length", "4"]
PROMPT = "def fib(n):\n"


@pytest.fixture(scope="module")
def moe():
    mp = interpreted_kernels("kernel_math", "moe_align_kernel", "moe_kernel")
    from oled.kernels import triton_moe

    yield triton_moe
    mp.undo()


def expert_blobs(count, seed=0):
    """bf16-layout blobs whose h, activation and output are O(1) (tests/test_triton_moe.py's scaling)."""
    g = torch.Generator().manual_seed(seed)
    blobs = torch.randn(count, 3 * I * H, generator=g) * H**-0.5
    blobs[:, 2 * I * H:] *= (H / I) ** 0.5
    return blobs


def inputs(tokens, dtype, seed=1):
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# quantisation


def test_quantise_then_dequantise_is_within_e4m3s_rounding():
    """Each weight comes back within half an e4m3 step of itself: 2^-4 relative for a normal value, 2^-10 of its
    row's scale for a subnormal one; rows of any magnitude (a zero row, tiny and huge ones) alike. Scales are powers
    of two with every |q| <= 448, and the dequantised weights are exact in bf16."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 256, generator=g) * torch.logspace(-12, 6, 8, base=2.0)[:, None]
    w[2] = 0.0
    w[5, :16] = 1e-9                               # far below the row's largest: subnormal or zero in e4m3
    q, scale = fp8.quantise(w)
    assert q.dtype == fp8.FP8 and scale.dtype == torch.float32 and q.shape == w.shape
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()                 # powers of two
    assert (q.float().abs() <= fp8.FP8_MAX).all() and q.float().isfinite().all()
    back = fp8.dequantise(q, scale, torch.float32)
    bound = torch.maximum(E4M3_HALF_ULP * w.abs(), E4M3_SUBNORMAL_HALF_STEP * scale[:, None])
    assert ((back - w).abs() <= bound).all()
    assert (back[2] == 0).all()
    # the largest magnitude of a row lands in e4m3's top binade (the scale is the smallest power of two that fits)
    nonzero = w.abs().amax(dim=1) > 0
    assert (q.float().abs().amax(dim=1)[nonzero] >= fp8.FP8_MAX / 2).all()
    assert torch.equal(fp8.dequantise(q, scale, torch.bfloat16).float(), back)


def test_a_blob_holds_the_weights_then_their_scales_and_the_store_quantises_as_it_loads():
    """The store's FP8 blob of an expert: its three projections quantised one by one as they stream in, laid out
    as quantise_blobs lays out the whole expert; part() gives the dequantised projection; half the bytes plus the
    scales of a bf16 blob."""
    raw = preset_config("tiny")
    config = config_from_dict(raw)
    store = ExpertStore(config, torch.float32, pin=False, expert_dtype="fp8")
    layer = config.moe_layers[0]
    blob = expert_blobs(1)[0]
    n = I * H
    for index, part in enumerate(PARTS):
        shape = (H, I) if part == "down_proj" else (I, H)
        store.put(layer, 3, part, blob[index * n:(index + 1) * n].view(shape))
    assert store.blob(layer, 3).dtype == torch.uint8
    assert torch.equal(store.blob(layer, 3), fp8.quantise_blobs(blob, H, I))
    assert store.expert_bytes == 3 * H * I + 4 * (2 * I + H) == fp8.blob_bytes(H, I)
    bf16 = ExpertStore(config, torch.bfloat16, pin=False)
    assert store.host_bytes == bf16.host_bytes // 2 + len(config.moe_layers) * config.num_experts * 4 * (2 * I + H)
    want = fp8.dequantise_blobs(store.blob(layer, 3), H, I, torch.float32)
    assert torch.equal(store.part(layer, 3, "down_proj"), want[2 * n:].view(H, I))
    with pytest.raises(ValueError, match="expected shape"):
        store.put(layer, 4, "gate_proj", torch.zeros(H, I))


# ---------------------------------------------------------------------------------------------------------------
# the fused MoE kernels (interpreter), the torch path


def _fused(moe, x, pair_slots, pool, **kw):
    out = torch.full((pair_slots.shape[0], H), SENTINEL, dtype=x.dtype)
    moe.fused_swiglu_pairs(x, pair_slots, pool, H, I, out, **kw)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kernels_give_the_bits_of_the_kernels_over_the_dequantised_weights(moe, dtype):
    """The kernels on an FP8 pool against the same kernels on that pool dequantised to x's dtype: the same bits
    (the tiles' e4m3 values are exact in bf16 and fp32, and the power-of-two scale on a column's fp32 sum is the
    scale on each of its products). Against torch's grouped path, which sums in another order: fp32 to rounding,
    bf16 within the bound tests/test_triton_moe.py gives bf16 experts. Rows without a slot are left as they were."""
    fp8_pool = fp8.quantise_blobs(expert_blobs(6), H, I)
    dequantised = fp8.dequantise_blobs(fp8_pool, H, I, dtype)
    x = inputs(5, dtype)
    pair_slots = torch.tensor([0, 4, 5, 1, 2, 3, 4, -1, 3, 5, 0, 1, 2, 2, -1, 5, 5, 0, 1, 3])      # k = 4
    got = _fused(moe, x, pair_slots, fp8_pool)
    assert torch.equal(got, _fused(moe, x, pair_slots, dequantised))
    assert (got[pair_slots < 0] == SENTINEL).all()
    order, y = grouped_swiglu(x, torch.arange(20) // 4, pair_slots, fp8_pool, H, I)     # the torch path
    want = torch.full_like(got, SENTINEL)
    served = int((pair_slots >= 0).sum())
    want.index_copy_(0, order[:served], y[:served])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-8 * float(want.abs().max()))


def test_the_cpu_path_dequantises_only_the_slots_with_pairs(monkeypatch):
    """On the CPU the torch path widens only the FP8 slots that pairs use (a pool of LLaDA2.0-flash's experts is
    6 GiB dequantised), with the same result as widening the whole pool; no pair in a slot gives no work."""
    pool = fp8.quantise_blobs(expert_blobs(16, seed=3), H, I)
    x = inputs(3, torch.float32, seed=5)
    pair_slots = torch.tensor([9, 2, -1, 9, 14, 2])                       # 3 tokens x k = 2; slots 2, 9, 14
    widened = []
    dequantise = fp8.dequantise_blobs
    monkeypatch.setattr(fp8, "dequantise_blobs", lambda b, *a: widened.append(len(b)) or dequantise(b, *a))
    order, y = grouped_swiglu(x, torch.arange(6) // 2, pair_slots, pool, H, I)
    assert widened == [3]
    ref_order, ref = grouped_swiglu(x, torch.arange(6) // 2, pair_slots, dequantise(pool, H, I, torch.float32), H, I)
    served = int((pair_slots >= 0).sum())
    assert torch.equal(order, ref_order) and torch.equal(y[:served], ref[:served])
    order, y = grouped_swiglu(x, torch.arange(6) // 2, torch.full((6,), -1), pool, H, I)
    assert widened == [3] and y.shape == (6, H)


def test_fp8_misses_read_from_host_memory_and_captured_equal_the_slots(moe):
    """Mapped misses from FP8 blobs in host memory give the bits of the same experts in slots; a captured miss lands
    in its free slot byte for byte (weights and scales), so a later load of it is never needed."""
    store = fp8.quantise_blobs(expert_blobs(8, seed=2), H, I)             # a layer's 8 experts
    x = inputs(3, torch.float32, seed=4)
    ids = torch.tensor([0, 5, 2, 7, 5, 1])                                   # k = 2
    resident = [0, 1, 2]
    pool = torch.zeros(4, store.shape[1], dtype=torch.uint8)                # 3 resident, 1 free
    pool[:3] = store[resident]
    slot_map = torch.full((8,), -1, dtype=torch.int64)
    slot_map[resident] = torch.arange(3)
    all_in_slots = _fused(moe, x, torch.tensor([0, 5, 2, 7, 5, 1]), store)
    mapped = _fused(moe, x, ids, pool, slot_map=slot_map, host=store)
    assert torch.equal(mapped, all_in_slots)
    captured = pool.clone()
    with_capture = _fused(moe, x, ids, captured, slot_map=slot_map, host=store, capture=torch.tensor([3, -1]))
    assert torch.equal(with_capture, all_in_slots)
    assert torch.equal(captured[3], store[5])                    # the first miss (in id order), weights and scales
    assert torch.equal(captured[:3], pool[:3])


def test_an_fp8_pool_refuses_the_shared_expert_and_other_layouts(moe):
    pool = fp8.quantise_blobs(expert_blobs(2), H, I)
    x = inputs(2, torch.bfloat16)
    out = torch.empty(4 + 2, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shared expert stays bf16"):
        moe.fused_swiglu_pairs(x, torch.tensor([0, 1, 1, 0]), pool, H, I, out,
                               shared=torch.zeros(3 * I * H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=f"pool must be \\[S, {fp8.blob_bytes(H, I)}\\]"):
        moe.fused_swiglu_pairs(x, torch.tensor([0, 1, 1, 0]), pool[:, :-4], H, I, out[:4])


# ---------------------------------------------------------------------------------------------------------------
# the CPU kernel


def _cpu_run(kernel_run, x, blobs):
    tok = torch.tensor([0, 1, 2, 3, 0, 2, 4], dtype=torch.int64)
    offsets = torch.tensor([0, 3, 5, 7], dtype=torch.int64)
    out = torch.empty(tok.shape[0], H)
    kernel_run(x, tok, offsets, [b for b in blobs], I, out)
    return out, tok, offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["portable", "auto"])
def test_the_cpu_kernel_on_fp8_blobs_gives_the_bits_of_the_dequantised_weights(dtype, isa):
    """The CPU kernel reads FP8 blobs, each row's sums scaled: the portable path widens them through a table, the
    AVX-512 BF16 path (auto, where the CPU has it; never AMX) in registers. Either gives the bits of the same path over
    the weights dequantised (to fp32 for the portable path, to bf16, exact, for the AVX-512 one: the path bf16 blobs
    take), and torch's SwiGLU over them to the path's rounding (the AVX-512 path rounds the tokens and the
    activations to bf16)."""
    kernel = CpuExpertKernel(num_threads=2, isa=isa, pin=False, spin_us=0.0)
    try:
        if kernel.name == "torch":
            pytest.skip("no C compiler: the kernel is torch's fallback")
        fast = kernel.name != "portable"
        blobs = fp8.quantise_blobs(expert_blobs(3, seed=5), H, I)
        dequantised = fp8.dequantise_blobs(blobs, H, I, torch.bfloat16 if fast else torch.float32)
        x = inputs(5, dtype, seed=6)
        got, tok, offsets = _cpu_run(kernel.run, x, blobs)
        assert torch.equal(got, _cpu_run(kernel.run, x, dequantised)[0])
        want = torch.empty_like(got)
        _torch_run(x, tok, offsets, list(fp8.dequantise_blobs(blobs, H, I, torch.float32)), I, want)
        tolerance = 3e-2 if fast else 1e-5
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        fallback = torch.empty_like(got)
        _torch_run(x, tok, offsets, list(blobs), I, fallback)              # the no-compiler path dequantises too
        assert torch.equal(fallback, want)
    finally:
        kernel.close()


def test_fp8_widening_in_registers_equals_the_table_for_every_byte():
    """Every e4m3 byte (subnormals, zeros of both signs, the largest, NaN) through the AVX-512 path: a blob whose
    rows hold all 256 values, against the same blob dequantised to bf16 (the table's values, exact in bf16)."""
    kernel = CpuExpertKernel(num_threads=1, isa="avx512_bf16", pin=False, spin_us=0.0)
    try:
        if kernel.name != "avx512_bf16":
            pytest.skip("the CPU or the compiler lacks AVX-512 BF16")
        h, i = 64, 32
        raw = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3 * h * i // 256)
        finite = raw.view(torch.float8_e4m3fn).float().isfinite()
        raw[~finite] = 0x38                                    # NaN bytes would make every sum NaN: 1.0 instead
        blob = torch.cat([raw, torch.ones(2 * i + h, dtype=torch.float32).view(torch.uint8)])
        x = torch.randn(3, h, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        tok = torch.tensor([0, 1, 2], dtype=torch.int64)
        offsets = torch.tensor([0, 3], dtype=torch.int64)
        out_fp8 = torch.empty(3, h, dtype=torch.float32)
        kernel.run(x, tok, offsets, [blob], i, out_fp8)
        out_bf16 = torch.empty_like(out_fp8)
        kernel.run(x, tok, offsets, [fp8.dequantise_blobs(blob, h, i, torch.bfloat16)], i, out_bf16)
        assert torch.equal(out_fp8, out_bf16) and out_fp8.isfinite().all()
    finally:
        kernel.close()


# ---------------------------------------------------------------------------------------------------------------
# bytes: the budget, traces, replay


def test_a_budget_in_bytes_holds_twice_the_fp8_experts():
    """The same bytes of GPU memory hold twice as many FP8 experts of llada2-mini's shape (a 6 MiB bf16 expert is
    3 MiB of e4m3 and 12 KiB of scales); fractions stay fractions of whatever the experts take."""
    config = config_from_dict(preset_config("llada2-mini"))
    hidden, inter = config.hidden_size, config.expert_intermediate_size
    shape = dict(num_layers=len(config.moe_layers), num_experts=config.num_experts)
    bf16 = parse_budget("12GiB", expert_bytes=3 * hidden * inter * 2, **shape)
    fp8_budget = parse_budget("12GiB", expert_bytes=fp8.blob_bytes(hidden, inter), **shape)
    assert fp8_budget.slots_per_layer == 2 * bf16.slots_per_layer
    assert fp8_budget.bytes <= 12 * 2**30 and math.isclose(fp8_budget.fraction, 2 * bf16.fraction, rel_tol=0.01)
    assert parse_budget("40%", expert_bytes=fp8.blob_bytes(hidden, inter), **shape).slots_per_layer == \
        parse_budget("40%", expert_bytes=3 * hidden * inter * 2, **shape).slots_per_layer


@pytest.fixture(scope="module")
def fp8_engine():
    engine = Engine(EngineConfig(random_weights="tiny", device="cpu", expert_dtype="fp8", policy="lru",
                                 expert_budget="0.5"))
    yield engine
    engine.manager.close()


def test_the_engine_budgets_traces_and_replays_fp8_bytes(fp8_engine, tmp_path):
    """An engine with FP8 experts sizes its slots, and the trace it records counts its loads, in FP8 blob bytes;
    a replay of that trace counts the live run's bytes."""
    engine = fp8_engine
    blob = fp8.blob_bytes(H, I)
    layers = len(engine.config.moe_layers)
    assert engine.store.expert_bytes == blob and engine.manager.cache.pool.dtype == torch.uint8
    engine.set_runtime("lru", f"{5 * layers * blob}b")
    assert engine.budget.slots_per_layer == 5 and engine.budget.bytes == 5 * layers * blob
    engine.set_runtime("lru", "0.5")
    trace, _ = record_trace(engine, [("p0", engine.tokenizer.encode(PROMPT))], DecodeParams(gen_length=16,
                                                                                            block_length=8))
    trace = Trace.load(trace.save(tmp_path / "fp8.trace"))
    assert trace.header["model"]["expert_bytes"] == blob and trace.header["engine"]["expert_dtype"] == "fp8"
    live = trace.header["live"]["totals"]
    assert live["bytes_h2d"] > 0 and live["bytes_h2d"] % blob == 0
    assert replay(trace, "lru", "0.5").stats.summary(kinds=("prefill", "iteration", "cache_fill"))["totals"] == live


# ---------------------------------------------------------------------------------------------------------------
# the engine


def _tokens(policy, budget, balanced=False, **settings):
    """Tokens and statistics of an FP8 tiny engine (fp32); balanced: the planner's costs set so that a cooperative
    policy gives the CPU kernel part of its misses on any machine."""
    engine = Engine(EngineConfig(random_weights="tiny", device="cpu", dtype="float32", expert_dtype="fp8",
                                 policy=policy, expert_budget=budget, cpu_threads=1, **settings))
    try:
        if balanced:
            engine.costs = balanced_costs(engine.store.expert_bytes)
            engine.set_runtime(policy, budget)
        ids = engine.tokenizer.encode(PROMPT)
        result = engine.generate_ids(ids, DecodeParams(gen_length=16, block_length=8))
        return result.token_ids, engine.manager.stats.summary()
    finally:
        engine.manager.close()


@pytest.fixture(scope="module")
def fp8_full_tokens():
    return _tokens("full", "1.0")[0]


@pytest.mark.parametrize("policy,budget,settings", [
    ("lru", "0.5", {}),                                                       # the host round trip, torch's GEMMs
    ("oled", "0.5", {}),
    ("lru", "0.5", dict(fused_moe=True, mapped_misses=True, capture_slots=2)),  # mapped misses, captured, kernels
    ("oled-coop", "0.25", dict(balanced=True)),                               # misses on the CPU kernel too
])
def test_offloading_fp8_experts_gives_the_tokens_of_fp8_experts_all_resident(moe, fp8_full_tokens, policy, budget,
                                                                             settings):
    tokens, summary = _tokens(policy, budget, **settings)
    assert summary["hit_rate_tokens"] < 1.0                                  # it offloads
    if settings.get("mapped_misses"):
        assert summary["mapped_pairs_per_iteration"] > 0 and summary["totals"]["experts_captured"] > 0
    if settings.get("balanced"):
        assert summary["cpu_pairs_per_iteration"] > 0
    assert tokens == fp8_full_tokens and len(tokens) == 16


def test_fp8_experts_change_the_numerics_but_not_the_dense_weights():
    """bf16 stays the default; the FP8 engine's dense weights are the bf16 engine's, its experts the quantised ones."""
    assert EngineConfig().expert_dtype == "bf16"
    kw = dict(random_weights="tiny", device="cpu", dtype="bfloat16", policy="full")
    plain, quantised = Engine(EngineConfig(**kw)), Engine(EngineConfig(expert_dtype="fp8", **kw))
    for (name, a), (_, b) in zip(plain.model.named_parameters(), quantised.model.named_parameters()):
        assert torch.equal(a, b), name
    layer = plain.config.moe_layers[0]
    assert plain.store.blob(layer, 0).dtype == torch.bfloat16
    assert torch.equal(quantised.store.blob(layer, 0), fp8.quantise_blobs(plain.store.blob(layer, 0), H, I))


# ---------------------------------------------------------------------------------------------------------------
# settings and host memory


def test_a_bad_expert_dtype_is_one_line_and_exit_2(capsys):
    rc = main(["generate", "hi", *TINY, "--expert-dtype", "fp16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["oled generate: error: expert_dtype (--expert-dtype) must be one of bf16, fp8, "
                               "got 'fp16'"]
    with pytest.raises(ValueError, match="must be one of bf16, fp8, got 'int4'"):
        Engine(EngineConfig(random_weights="tiny", device="cpu", expert_dtype="int4"))


@pytest.mark.parametrize("layer_bytes,layers", [(256 * fp8.blob_bytes(4096, 1024), 31),     # flash, FP8
                                                (256 * 3 * 2048 * 512 * 2, 19),               # mini, bf16
                                                (16 * fp8.blob_bytes(H, I), 2), (3, 7), (5, 1), (2**20, 8)])
def test_pinned_layers_are_grouped_so_the_allocators_powers_of_two_waste_less_than_a_layer_each(layer_bytes, layers):
    """torch's pinned allocator rounds an allocation up to a power of two: the store pins its layers in groups,
    each of which, rounded so, leaves less than a layer unused (a layer an allocation would leave up to a layer's
    bytes less one)."""
    groups = pinned_layer_groups(layer_bytes, layers)
    assert sum(groups) == layers and min(groups) >= 1
    for count in groups:
        rounded = 1 << (count * layer_bytes - 1).bit_length()
        assert count * layer_bytes <= rounded < count * layer_bytes + layer_bytes
    assert pinned_bytes(layer_bytes, layers) == sum(1 << (c * layer_bytes - 1).bit_length() for c in groups)


def test_a_store_that_cannot_pin_falls_back_to_pageable_memory():
    if torch.cuda.is_available():
        pytest.skip("this machine can pin")
    store = ExpertStore(config_from_dict(preset_config("tiny")), torch.float32, pin=True, expert_dtype="fp8")
    assert not store.pinned and store.pinned_failed
    assert [tuple(b.shape) for b in store.blobs] == [(16, fp8.blob_bytes(H, I))] * 2


def _meminfo(monkeypatch, tmp_path, gib: float) -> None:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {int(128 * 2**20)} kB\nMemAvailable:   {int(gib * 2**20)} kB\n")
    monkeypatch.setattr(host_memory, "MEMINFO", path)


def test_flash_is_checked_against_host_memory_before_loading(monkeypatch, tmp_path, capsys):
    """LLaDA2.0-flash, every layer: 31 MoE layers x 256 experts. In bf16 its experts (186 GiB) do not fit a 128 GB
    host, in FP8 (93.2 GiB: e4m3 and scales) they do; a machine with less is refused in one line before anything
    is allocated."""
    config = config_from_dict(preset_config("llada2-flash"))
    experts = 31 * 256 * (3 * 4096 * 1024 + 4 * (2 * 1024 + 4096))
    assert host_memory.weight_bytes(config, torch.bfloat16, "fp8")[0] == experts
    assert host_memory.weight_bytes(config, torch.bfloat16)[0] == 31 * 256 * 3 * 4096 * 1024 * 2
    _meminfo(monkeypatch, tmp_path, 120)
    cuda = torch.device("cuda")
    host_memory.check_host_memory(config, torch.bfloat16, cuda, "flash", "fp8", pin=True)     # fits
    with pytest.raises(MemoryError, match=r"needs 192.0 GiB .* \(routed experts 186.0 GiB, 192.0 GiB pinned\)"
                                          r".* Use fewer --layers, --expert-dtype fp8 or"):
        host_memory.check_host_memory(config, torch.bfloat16, cuda, "flash", pin=True)
    _meminfo(monkeypatch, tmp_path, 95)          # the experts' bytes, not the pinned groups' (21 and 10 layers)
    with pytest.raises(MemoryError, match=r"needs 96.0 GiB .* in fp8, 96.0 GiB pinned\); 95.0 GiB is available"):
        host_memory.check_host_memory(config, torch.bfloat16, cuda, "flash", "fp8", pin=True)
    _meminfo(monkeypatch, tmp_path, 64)
    rc = main(["generate", "hi", "--random-weights", "llada2-flash", "--device", "cpu", "--dtype", "bfloat16",
               "--expert-dtype", "fp8"])
    err = capsys.readouterr().err.strip().splitlines()
    other = host_memory.weight_bytes(config, torch.bfloat16)[1]
    assert rc == 2 and len(err) == 1
    assert err[0] == (f"oled generate: error: preset llada2-flash needs {(experts + other) / 2**30:.1f} GiB of host "
                      f"memory in bfloat16 (routed experts {experts / 2**30:.1f} GiB in fp8 + other weights "
                      f"{other / 2**30:.1f} GiB); 64.0 GiB is available. Use fewer --layers or a larger machine")
