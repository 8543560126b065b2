"""The fused routed-experts kernels (oled/kernels/triton_moe.py) on the CPU through Triton's interpreter: equal to
the torch grouped path and to a per-pair loop in fp32, close to the torch path in bf16, rows without a slot left
untouched, a pair's bits independent of the rest of the call, and the engine's tokens unchanged with --fused-moe.
The sm_90 compile of these kernels is in tests/test_triton_kernels.py."""
from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from oled.runtime.grouped import grouped_swiglu
from tests.triton_interpreter import import_triton_for_the_interpreter, interpreted_kernels

triton = import_triton_for_the_interpreter()

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]   # exp(-x) of a large -x

SENTINEL = 7.25           # fills `out` before a call: rows without a slot must still hold it


@pytest.fixture(scope="module")
def moe():
    mp = interpreted_kernels("kernel_math", "moe_align_kernel", "moe_kernel")
    from oled.kernels import moe_align_kernel, moe_kernel, triton_moe, triton_support

    assert triton_support.interpreted(moe_kernel.gate_up_kernel)
    assert triton_support.interpreted(moe_align_kernel.align_pairs_kernel)
    yield SimpleNamespace(run=triton_moe.fused_swiglu_pairs, module=triton_moe, Tiles=triton_moe.MoeTiles,
                          kernels=(moe_align_kernel, moe_kernel))
    mp.undo()


def expert_pool(slots, hidden, inter, dtype=torch.float32, seed=0):
    """Blobs gate | up | down scaled so that h, the activation and the output are all O(1)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(slots, 3 * inter * hidden, generator=g) * hidden**-0.5
    pool[:, 2 * inter * hidden:] *= (hidden / inter) ** 0.5
    return pool.to(dtype)


def inputs(tokens, hidden, dtype=torch.float32, seed=1):
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fused(moe, x, pair_slots, pool, hidden, inter, **kw):
    out = torch.full((pair_slots.shape[0], hidden), SENTINEL, dtype=x.dtype)
    moe.run(x, pair_slots, pool, hidden, inter, out, **kw)
    return out


def torch_path(x, pair_slots, pool, hidden, inter, slot_base=0):
    """What ExpertCompute.grouped does: grouped_swiglu, then the served rows copied to their pairs."""
    k = pair_slots.shape[0] // x.shape[0]
    order, y = grouped_swiglu(x, torch.arange(pair_slots.shape[0]) // k, pair_slots, pool, hidden, inter,
                              slot_base=slot_base)
    out = torch.full((pair_slots.shape[0], hidden), SENTINEL, dtype=x.dtype)
    served = int((pair_slots >= 0).sum())
    return out.index_copy_(0, order[:served], y[:served])


def per_pair(x, pair_slots, pool, hidden, inter, slot_base=0):
    """One expert at a time, in fp32, straight from the blob layout."""
    k = pair_slots.shape[0] // x.shape[0]
    out = torch.full((pair_slots.shape[0], hidden), SENTINEL)
    for p, slot in enumerate(pair_slots.tolist()):
        if slot < 0:
            continue
        gate, up, down = pool[slot - slot_base].float().split([inter * hidden, inter * hidden, hidden * inter])
        xt = x[p // k].float()
        out[p] = down.view(hidden, inter) @ (F.silu(gate.view(inter, hidden) @ xt) * (up.view(inter, hidden) @ xt))
    return out


def routing(tokens, top_k, slots, seed=0, missing=0.0):
    """Token-major pair slots, k distinct slots a token, a fraction `missing` of the pairs without one (-1)."""
    g = torch.Generator().manual_seed(seed)
    pair_slots = torch.stack([torch.randperm(slots, generator=g)[:top_k] for _ in range(tokens)]).reshape(-1)
    return torch.where(torch.rand(pair_slots.shape, generator=g) < missing, -1, pair_slots)


def assert_fp32_equal(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


CASES = {
    # name: (tokens, k, slots, hidden, intermediate, pair_slots or None for routing(...) with 30 % missing)
    "ragged": (7, 3, 5, 32, 16, None),
    "one-slot-many-blocks": (40, 1, 3, 32, 16, torch.arange(40) % 2),          # 20 pairs a slot: 2 blocks each
    "empty-slots-and-last": (6, 2, 8, 48, 32, torch.tensor([1, 7, 5, 7, 1, -1, 7, 5, 1, 7, -1, 5])),
    "all-missing": (4, 2, 3, 32, 16, torch.full((8,), -1)),
    "single-pair": (1, 1, 4, 32, 16, torch.tensor([3])),
    "duplicate-slots-across-tokens": (9, 2, 2, 16, 16, torch.tensor([0, 1] * 9)),
    "tiny-model": (21, 4, 16, 64, 32, None),                                     # the bundled tiny shapes
}


@pytest.mark.parametrize("name", CASES)
def test_matches_the_torch_path_and_a_per_pair_loop_in_fp32(moe, name):
    tokens, k, slots, hidden, inter, pair_slots = CASES[name]
    if pair_slots is None:
        pair_slots = routing(tokens, k, slots, seed=tokens, missing=0.3)
    pool, x = expert_pool(slots, hidden, inter), inputs(tokens, hidden)
    got = fused(moe, x, pair_slots, pool, hidden, inter)
    assert_fp32_equal(got, torch_path(x, pair_slots, pool, hidden, inter))
    assert_fp32_equal(got, per_pair(x, pair_slots, pool, hidden, inter))
    assert (got[pair_slots < 0] == SENTINEL).all()                              # untouched, bit for bit


@pytest.mark.parametrize("pairs,slots,base,block_m", [(2500, 5, 0, 16), (300, 256, 0, 16), (37, 7, 3, 32)],
                         ids=["many-passes-and-blocks", "llada2-slots", "slot_base"])
def test_the_alignment_layout(moe, pairs, slots, base, block_m):
    """Launch 1 alone: every pair with a slot in the pool once, in a block of its slot, in pair order (the
    interpreter's atomics run in lane order); -1 padding up to each slot's last block; the spare blocks of the
    static bound marked -1. 2,500 pairs are three passes of 1,024 and a slot's many blocks."""
    g = torch.Generator().manual_seed(pairs)
    pair_slots = torch.randint(-1, base + slots + 2, (pairs,), generator=g)        # some outside the pool
    sorted_pairs, block_slots, _ = moe.module.align_pairs(pair_slots, slots, base, block_m)
    assert sorted_pairs.shape == (moe.module.padded_rows(pairs, slots, block_m),)
    assert block_slots.shape == (sorted_pairs.shape[0] // block_m,)
    rel = pair_slots - base
    inside = (pair_slots >= 0) & (rel >= 0) & (rel < slots)
    row = 0
    for slot in range(slots):
        mine = torch.nonzero(inside & (rel == slot)).flatten()
        span = -(-len(mine) // block_m) * block_m
        assert sorted_pairs[row:row + len(mine)].tolist() == mine.tolist()
        assert (sorted_pairs[row + len(mine):row + span] == -1).all()
        assert (block_slots[row // block_m:(row + span) // block_m] == slot).all()
        row += span
    assert (block_slots[row // block_m:] == -1).all()


def test_looking_the_slots_up_in_a_slot_map_equals_passing_them(moe):
    """slot_map: pair_slots holds expert ids and the alignment looks each slot up (the manager's device slot map
    row, -1 for an expert not resident): the same outputs, bit for bit, as slots looked up before the call, and the
    same layout."""
    tokens, k, experts, slots, hidden, inter = 6, 4, 12, 5, 32, 16
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).reshape(-1)
    slot_map = torch.full((experts,), -1, dtype=torch.int64)
    resident = torch.randperm(experts, generator=g)[:slots]
    slot_map[resident] = torch.arange(slots) + 2                                   # a layer starting at slot 2
    pool, x = expert_pool(slots, hidden, inter), inputs(tokens, hidden)
    looked_up = fused(moe, x, ids, pool, hidden, inter, slot_base=2, slot_map=slot_map)
    given = fused(moe, x, slot_map.index_select(0, ids), pool, hidden, inter, slot_base=2)
    assert torch.equal(looked_up, given)
    assert (looked_up[slot_map[ids] < 0] == SENTINEL).all() and (looked_up[slot_map[ids] >= 0] != SENTINEL).any()
    (pairs_a, blocks_a, _), (pairs_b, blocks_b, _) = (moe.module.align_pairs(ids, slots, 2, 16, slot_map),
                                                      moe.module.align_pairs(slot_map.index_select(0, ids), slots, 2, 16))
    used = int((blocks_a >= 0).sum()) * 16               # rows past the used blocks are never written
    assert torch.equal(blocks_a, blocks_b) and torch.equal(pairs_a[:used], pairs_b[:used])


@pytest.mark.parametrize("tokens, k, weight_dtype", [(5, 4, torch.float32), (1, 8, torch.bfloat16),
                                                     (200, 8, torch.float32)],
                         ids=["fp32-weights", "bf16-weights-one-token", "several-passes"])
def test_the_alignment_stores_the_routing_for_the_host(moe, tokens, k, weight_dtype):
    """routing=(weights, dst): the alignment writes the call's ids (int64, as two int32 halves) and weights (fp32
    bits) into dst row by row, as ExpertManager reads its read-back, and aligns the pairs as it does without it.
    200 x 8 pairs take two passes of 1,024."""
    experts = 300
    ids, _, _, _, slot_map = partly_resident(experts, 16, 16, 2, 40, tokens, k, torch.float32, seed=11)
    weights = torch.rand(tokens, k, generator=torch.Generator().manual_seed(5)).to(weight_dtype)
    dst = torch.full((tokens, 3 * k), -7, dtype=torch.int32)
    with_routing = moe.module.align_pairs(ids, 40, 2, 16, slot_map, routing=(weights, dst))
    without = moe.module.align_pairs(ids, 40, 2, 16, slot_map)
    assert torch.equal(dst[:, : 2 * k].contiguous().view(torch.int64), ids.view(tokens, k))
    assert torch.equal(dst[:, 2 * k:].contiguous().view(torch.float32), weights.float())
    used = int((without[1] >= 0).sum()) * 16
    assert torch.equal(with_routing[1], without[1]) and torch.equal(with_routing[0][:used], without[0][:used])
    with pytest.raises(ValueError, match="routing must be"):
        moe.module.align_pairs(ids, 40, 2, 16, slot_map, routing=(weights, dst[:, 1:]))
    with pytest.raises(ValueError, match="routing must be"):        # the routing comes from the looked-up ids
        moe.module.align_pairs(slot_map[ids], 40, 2, 16, routing=(weights, dst))


def partly_resident(experts, hidden, inter, base, resident, tokens, k, dtype, seed):
    """A layer's store of `experts` blobs, `tokens` x `k` distinct routed ids, and a slot map holding `resident`
    random experts in slots base, base + 1, ...: (ids, store, x, held experts, slot_map)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).reshape(-1)
    store, x = expert_pool(experts, hidden, inter, dtype, seed=seed + 1), inputs(tokens, hidden, dtype)
    held = torch.randperm(experts, generator=g)[:resident]
    slot_map = torch.full((experts,), -1, dtype=torch.int64)
    slot_map[held] = torch.arange(resident) + base
    return ids, store, x, held, slot_map


@pytest.mark.parametrize("resident, tokens, k", [(5, 6, 4), (0, 3, 2), (12, 5, 3), (3, 40, 2)],
                         ids=["some-resident", "none-resident", "all-resident", "many-tokens-an-expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_misses_read_from_host_memory_equal_the_same_experts_in_slots(moe, resident, tokens, k, dtype):
    """host: a pair whose expert the slot map does not hold is computed from the expert's blob in host memory
    (the layer's store), so every row is written, and with the bits it gets when the expert sits in a slot: the same
    loads in the same order, whichever memory they read. The layout puts host experts in bins after the pool."""
    experts, hidden, inter, base = 12, 32, 16, 3
    ids, store, x, held, slot_map = partly_resident(experts, hidden, inter, base, resident, tokens, k, dtype, seed=4)
    pool = store[held] if resident else store[:0]
    mapped = fused(moe, x, ids, pool, hidden, inter, slot_base=base, slot_map=slot_map, host=store)
    every = torch.arange(experts) + base                     # every expert in a slot: the reference
    in_slots = fused(moe, x, ids, store, hidden, inter, slot_base=base, slot_map=every)
    assert torch.equal(mapped, in_slots)
    if dtype == torch.float32:
        assert_fp32_equal(mapped, per_pair(x, ids, store, hidden, inter))
    sorted_pairs, block_slots, _ = moe.module.align_pairs(ids, resident + experts, base, 16, slot_map,
                                                      host_bin=resident, mapped=True)
    bins = [b for b in block_slots.tolist() if b >= 0]
    on_host = {b - resident for b in bins if b >= resident}
    assert on_host == set(ids[slot_map[ids] < 0].tolist())
    assert {b for b in bins if b < resident} == set((slot_map[ids][slot_map[ids] >= 0] - base).tolist())
    # the experts read from host memory own the first blocks (in id order), then the pool's slots (in slot order)
    from_host = [b >= resident for b in bins]
    assert from_host == sorted(from_host, reverse=True) and bins == sorted(bins, key=lambda b: (b < resident, b))


def capture_call(moe, x, ids, pool, hidden, inter, base, slot_map, store, capture):
    """The call with capture on a copy of pool, checked to give the outputs of the call without it; returns that
    pool and the call's misses (experts without a slot) in increasing id."""
    plain = fused(moe, x, ids, pool.clone(), hidden, inter, slot_base=base, slot_map=slot_map, host=store)
    captured_pool = pool.clone()
    got = fused(moe, x, ids, captured_pool, hidden, inter, slot_base=base, slot_map=slot_map, host=store,
                capture=capture)
    assert torch.equal(got, plain)
    return captured_pool, sorted(set(ids[slot_map[ids] < 0].tolist()))


@pytest.mark.parametrize("free, tokens, k", [(4, 6, 4), (2, 5, 3), (6, 40, 2), (3, 2, 1)],
                         ids=["fewer-free-than-misses", "two-free", "many-tokens-an-expert", "more-free-than-misses"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_misses_land_in_the_free_slots_in_expert_order(moe, free, tokens, k, dtype):
    """capture: the experts read from host memory, in increasing id, are written into the free slots in turn as
    their tiles are read, so each captured slot holds its expert's blob bit for bit; the outputs are those of the
    call without capture; every other slot (resident, free and not taken) is left as it was."""
    experts, hidden, inter, base, resident = 12, 32, 16, 3, 5
    ids, store, x, held, slot_map = partly_resident(experts, hidden, inter, base, resident, tokens, k, dtype, seed=8)
    pool = torch.cat([store[held], torch.full((free, store.shape[1]), SENTINEL, dtype=dtype)])
    capture = torch.arange(free, dtype=torch.int64) + base + resident
    capture = torch.cat([capture, torch.tensor([-1])])          # -1 past the last free slot: never taken
    captured_pool, misses = capture_call(moe, x, ids, pool, hidden, inter, base, slot_map, store, capture)
    taken = misses[:free]
    assert taken, "the test needs misses"
    for i, e in enumerate(taken):
        assert torch.equal(captured_pool[resident + i], store[e]), (i, e)
    assert (captured_pool[resident + len(taken):] == SENTINEL).all()          # free slots not taken: untouched
    assert torch.equal(captured_pool[:resident], pool[:resident])             # resident slots: untouched
    with pytest.raises(ValueError, match="capture needs slot_map and host"):
        fused(moe, x, ids, pool.clone(), hidden, inter, slot_base=base, slot_map=slot_map, capture=capture)


def test_a_slot_the_call_reads_is_never_captured_into(moe):
    """capture may name slots that hold an expert (the host's next victims): one that a pair of the call is computed
    from is skipped, so its expert stays intact and its pairs are right; the misses take the other named slots in
    order (free or holding an unread expert, which is overwritten)."""
    experts, hidden, inter, base, resident, tokens, k = 12, 32, 16, 3, 5, 6, 3
    ids, store, x, held, slot_map = partly_resident(experts, hidden, inter, base, resident, tokens, k, torch.float32,
                                                    seed=12)
    read = [i for i in range(resident) if int(held[i]) in set(ids.tolist())]
    unread = [i for i in range(resident) if i not in read]
    assert read and unread, "the test needs a resident expert the call reads and one it does not"
    pool = torch.cat([store[held], torch.full((1, store.shape[1]), SENTINEL)])   # slot base + resident: free
    capture = torch.tensor([base + read[0], base + resident, base + unread[0]], dtype=torch.int64)
    captured_pool, misses = capture_call(moe, x, ids, pool, hidden, inter, base, slot_map, store, capture)
    assert len(misses) >= 2
    assert torch.equal(captured_pool[read[0]], pool[read[0]])                # read this call: skipped
    assert torch.equal(captured_pool[resident], store[misses[0]])            # the free slot: the first miss
    assert torch.equal(captured_pool[unread[0]], store[misses[1]])           # the unread victim: the second
    others = [i for i in range(resident) if i not in (read[0], unread[0])]
    assert torch.equal(captured_pool[others], pool[others])


def test_explicit_host_slots_equal_the_slot_map_lookup(moe):
    """Without slot_map, a pair slot slot_base + S + e names expert e's blob in host memory (the offloaded path's
    first wave, serving misses from host memory beside its loads); -1 and other slots as before."""
    experts, hidden, inter, base, slots = 10, 32, 16, 4, 3
    g = torch.Generator().manual_seed(6)
    ids = torch.stack([torch.randperm(experts, generator=g)[:3] for _ in range(5)]).reshape(-1)
    store, x = expert_pool(experts, hidden, inter, seed=7), inputs(5, hidden)
    pool = store[:slots]                                        # experts 0..2 in slots base..base+2
    explicit = torch.where(ids < slots, ids + base, base + slots + ids)
    explicit[::4] = -1                                          # some pairs served elsewhere: left untouched
    got = fused(moe, x, explicit, pool, hidden, inter, slot_base=base, host=store)
    want = fused(moe, x, torch.where(explicit < 0, -1, ids + base), store, hidden, inter, slot_base=base)
    assert torch.equal(got, want) and (got[::4] == SENTINEL).all()


def shared_call(moe, x, ids, pool, hidden, inter, shared, **kw):
    """The call with the shared expert as T more pairs: [T * k + T, H], SENTINEL where nothing was written."""
    out = torch.full((ids.shape[0] + x.shape[0], hidden), SENTINEL, dtype=x.dtype)
    moe.run(x, ids, pool, hidden, inter, out, shared=shared, **kw)
    return out


@pytest.mark.parametrize("resident, tokens, k, mapped", [(5, 6, 4, False), (5, 6, 4, True), (0, 3, 2, True),
                                                         (12, 40, 2, False), (0, 17, 1, False)],
                         ids=["slots", "mapped", "none-resident-mapped", "many-tokens", "only-the-shared-expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_expert_as_more_pairs_of_the_same_call(moe, resident, tokens, k, mapped, dtype):
    """shared: rows T * k + t hold the shared expert on x[t], with the bits of the same blob computed as a routed
    expert (so the offloaded path, which computes it with its hits, and the one-graph paths agree); the routed rows
    are those of the call without it, bit for bit, and the routing stored for the host is the routed pairs'
    only. In fp32 the shared rows equal a per-pair loop."""
    experts, hidden, inter, base = 12, 32, 16, 3
    ids, store, x, held, slot_map = partly_resident(experts, hidden, inter, base, resident, tokens, k, dtype,
                                                    seed=21)
    if resident == 0 and not mapped:
        ids = torch.full_like(ids, -1)                     # no routed pair has a slot: the shared expert alone
    pool = store[held] if resident else store[:0]
    shared = expert_pool(1, hidden, inter, dtype, seed=22)[0]
    kw = dict(slot_base=base, slot_map=slot_map, host=store if mapped else None)
    weights = torch.rand(tokens, k)
    dst, dst_plain = (torch.full((tokens, 3 * k), -1, dtype=torch.int32) for _ in range(2))
    got = shared_call(moe, x, ids, pool, hidden, inter, shared, routing=(weights, dst), **kw)
    plain = fused(moe, x, ids, pool, hidden, inter, routing=(weights, dst_plain), **kw)
    routed = ids.shape[0]
    assert torch.equal(got[:routed], plain)
    stored = torch.cat([ids.view(tokens, k).contiguous().view(torch.int32), weights.view(torch.int32)], 1)
    assert torch.equal(dst, stored)
    # the shared expert as a routed expert of its own: every token's pair in one slot
    as_routed = fused(moe, x, torch.zeros(tokens, dtype=torch.int64), shared[None], hidden, inter)
    assert torch.equal(got[routed:], as_routed)
    if dtype == torch.float32:
        assert_fp32_equal(got[routed:], per_pair(x, torch.zeros(tokens, dtype=torch.int64), shared[None], hidden,
                                                 inter))


def test_the_shared_expert_beside_captured_misses(moe):
    """With capture, the shared expert's bin is never taken for a miss read from host memory: the captured slots
    hold the misses in increasing id as without it, and every output row is the plain call's."""
    experts, hidden, inter, base, resident, tokens, k, free = 12, 32, 16, 3, 5, 6, 4, 3
    ids, store, x, held, slot_map = partly_resident(experts, hidden, inter, base, resident, tokens, k,
                                                    torch.float32, seed=23)
    pool = torch.cat([store[held], torch.full((free, store.shape[1]), SENTINEL)])
    capture = torch.arange(free, dtype=torch.int64) + base + resident
    shared = expert_pool(1, hidden, inter, seed=24)[0]
    pools = pool.clone(), pool.clone()
    got = shared_call(moe, x, ids, pools[0], hidden, inter, shared, slot_base=base, slot_map=slot_map, host=store,
                      capture=capture)
    plain = fused(moe, x, ids, pools[1], hidden, inter, slot_base=base, slot_map=slot_map, host=store,
                  capture=capture)
    assert torch.equal(got[:ids.shape[0]], plain) and torch.equal(pools[0], pools[1])
    misses = sorted(set(ids[slot_map[ids] < 0].tolist()))
    assert torch.equal(pools[0][resident], store[misses[0]])


def test_the_shared_blob_must_match_the_pool(moe):
    H, I = 32, 16
    x, ids, pool = inputs(2, H), torch.tensor([0, 1]), expert_pool(2, H, I)
    for shared, rows in ((pool[0], 2), (pool[0, :-1], 4), (pool[0].double(), 4), (pool[:1], 4)):
        with pytest.raises(ValueError):
            moe.run(x, ids, pool, H, I, torch.empty(rows, H), shared=shared)


def test_host_memory_needs_the_store_layout(moe):
    H, I, E = 32, 16, 6
    x, ids, store = inputs(2, H), torch.tensor([0, 5]), expert_pool(E, H, I)
    slot_map, out = torch.full((E,), -1, dtype=torch.int64), torch.empty(2, H)
    for kw in (dict(host=store[:, :-1], slot_map=slot_map),
               dict(host=store.double(), slot_map=slot_map), dict(host=store[:4], slot_map=slot_map)):
        with pytest.raises(ValueError):
            moe.run(x, ids, store[:0], H, I, out, **kw)


def test_a_slice_of_a_larger_pool_with_slot_base(moe):
    """The manager's call: one layer's slots sliced from the whole pool, global slot numbers; slots outside the
    slice are skipped (their rows untouched) rather than read."""
    hidden, inter, base, slots = 32, 16, 6, 4
    whole = expert_pool(3 * slots, hidden, inter)
    pool = whole[base:base + slots]
    pair_slots = torch.tensor([6, 9, -1, 7, 8, 9, 2, 6, 10, 9])                   # 2 and 10 are another layer's
    x = inputs(5, hidden)
    got = fused(moe, x, pair_slots, pool, hidden, inter, slot_base=base)
    inside = torch.where((pair_slots >= base) & (pair_slots < base + slots), pair_slots, -1)
    assert_fp32_equal(got, torch_path(x, inside, pool, hidden, inter, slot_base=base))
    assert (got[inside < 0] == SENTINEL).all()


@pytest.mark.parametrize("tiles", [dict(block_m=32), dict(gate_up_n=16, gate_up_k=16, down_n=16, down_k=16),
                                   dict(gate_up_n=256, gate_up_k=512, down_n=512, down_k=256)],
                         ids=["block_m=32", "smallest", "wider-than-the-dims"])
def test_other_tiles(moe, tiles):
    hidden, inter = 64, 32
    pair_slots = routing(19, 3, 6, seed=5, missing=0.2)
    pool, x = expert_pool(6, hidden, inter), inputs(19, hidden)
    got = fused(moe, x, pair_slots, pool, hidden, inter, tiles=moe.Tiles(**tiles))
    assert_fp32_equal(got, torch_path(x, pair_slots, pool, hidden, inter))


def test_a_pair_gives_the_same_bits_alone_among_many_and_in_any_slot(moe):
    """Residency must not change results: pair 5 computed alone, among every other pair, with its expert in
    another slot and with the other experts moved too, is bit-identical."""
    hidden, inter, slots, tokens, k = 64, 32, 8, 12, 3
    pool, x = expert_pool(slots, hidden, inter), inputs(tokens, hidden)
    many = routing(tokens, k, slots, seed=2)
    alone = torch.full_like(many, -1)
    alone[5] = many[5]
    reference = fused(moe, x, alone, pool, hidden, inter)[5]
    assert torch.equal(fused(moe, x, many, pool, hidden, inter)[5], reference)
    moved = torch.randperm(slots, generator=torch.Generator().manual_seed(3))   # slot s -> moved[s]
    moved_pool = torch.empty_like(pool)
    moved_pool[moved] = pool
    assert torch.equal(fused(moe, x, moved[many], moved_pool, hidden, inter)[5], reference)
    crowd = many.clone()
    crowd[:] = many[5]                                   # every pair on the same expert: pair 5 in a later row
    assert torch.equal(fused(moe, x, crowd, pool, hidden, inter)[5], reference)


def test_bf16_is_close_to_the_torch_path(moe):
    """bf16 as in the engine: the same rounding points as the torch path, so nearly every element has the same
    bits; the rest differ by the order of the fp32 sums, by at most 2 bf16 ulps of the output's magnitude."""
    hidden, inter, slots, tokens, k = 128, 64, 16, 16, 4
    pool, x = expert_pool(slots, hidden, inter, torch.bfloat16), inputs(tokens, hidden, torch.bfloat16)
    pair_slots = routing(tokens, k, slots, seed=4, missing=0.25)
    got, want = fused(moe, x, pair_slots, pool, hidden, inter), torch_path(x, pair_slots, pool, hidden, inter)
    assert (got == want).float().mean() >= 0.99
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-8 * float(want.abs().max()))
    assert (got[pair_slots < 0] == SENTINEL).all()


def test_the_call_is_three_launches_and_allocations_only(moe, monkeypatch):
    """The alignment, gate|up and down kernels whatever the routing, and no other tensor work than allocations
    (no op whose shape or result the host would wait for): what a CUDA graph can capture and replay. The kernels
    are stand-ins here that only count (the interpreter's own tensor handling would show up as ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    launches = Counter()

    class Counted:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            launches[self.name] += 1
            return lambda *args, **kwargs: None

    for module in moe.kernels:
        for name in ("align_pairs_kernel", "gate_up_kernel", "down_kernel"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, Counted(name))
    monkeypatch.setattr(moe.module, "check_device", lambda *a: None)    # they take the stand-ins for compiled
    monkeypatch.setattr(moe.module, "interpreted", lambda kernel: True)

    class TorchOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    hidden, inter = 32, 16
    pool, x = expert_pool(6, hidden, inter), inputs(10, hidden)
    for pair_slots in (routing(10, 2, 6, seed=1, missing=0.2), torch.full((20,), -1),
                       torch.zeros(20, dtype=torch.int64)):
        out = torch.empty(20, hidden)
        launches.clear()
        with TorchOps() as ops:
            moe.run(x, pair_slots, pool, hidden, inter, out)
        assert ops.ops == {"aten.empty.memory_format": 4}, ops.ops
        assert launches == {"align_pairs_kernel": 1, "gate_up_kernel": 1, "down_kernel": 1}


def test_nothing_to_do(moe):
    out = torch.full((0, 32), SENTINEL)
    moe.run(torch.zeros(0, 32), torch.zeros(0, dtype=torch.int64), expert_pool(2, 32, 16), 32, 16, out)
    out = torch.full((4, 32), SENTINEL)
    moe.run(inputs(2, 32), torch.tensor([0, 1, 0, 1]), torch.zeros(0, 3 * 16 * 32), 32, 16, out)
    assert (out == SENTINEL).all()


def test_strided_inputs_are_copied_and_strided_rows_written_in_place(moe):
    hidden, inter = 32, 16
    pool = expert_pool(4, hidden, inter)
    x_t = inputs(hidden, 6).t()                                  # [6, 32], column stride 6
    pair_slots = torch.stack([torch.tensor([0, 1, 2, 3, 1, 2]), torch.tensor([9] * 6)], dim=1)[:, 0]   # stride 2
    assert x_t.stride(1) != 1 and pair_slots.stride(0) != 1
    wide = torch.full((6, 2 * hidden), SENTINEL)
    out = wide[:, :hidden]                                       # rows contiguous, row stride 2H
    moe.run(x_t, pair_slots, pool, hidden, inter, out)
    assert_fp32_equal(out, torch_path(x_t.contiguous(), pair_slots.contiguous(), pool, hidden, inter))
    assert (wide[:, hidden:] == SENTINEL).all()


def bad_calls():
    H, I = 32, 16
    x, s, pool, out = inputs(2, H), torch.tensor([0, 1]), expert_pool(2, H, I), torch.empty(2, H)
    yield "x shape", (inputs(2, 48), s, pool, H, I, out)
    yield "pairs dtype", (x, s.int(), pool, H, I, out)
    yield "pairs not a multiple of tokens", (x, torch.tensor([0, 1, 0]), pool, H, I, torch.empty(3, H))
    yield "pool width", (x, s, pool[:, :-1], H, I, out)
    yield "pool columns strided", (x, s, torch.empty(2, 2 * 3 * I * H)[:, ::2], H, I, out)
    yield "out shape", (x, s, pool, H, I, torch.empty(3, H))
    yield "out columns strided", (x, s, pool, H, I, torch.empty(2, 2 * H)[:, ::2])
    yield "dtypes differ", (x, s, pool.bfloat16(), H, I, out)
    yield "fp64", (x.double(), s, pool.double(), H, I, out.double())
    yield "devices differ", (x, s, pool, H, I, torch.empty(2, H, device="meta"))
    yield "intermediate not a multiple of 16", (x, s, expert_pool(2, H, 8), H, 8, out)
    yield "negative slot_base", (x, s, pool, H, I, out, -1)


@pytest.mark.parametrize("case", list(bad_calls()), ids=[name for name, _ in bad_calls()])
def test_bad_calls_are_one_value_error(moe, case):
    _, args = case
    *args, base = args if len(args) == 7 else (*args, 0)
    with pytest.raises(ValueError):
        moe.run(*args, slot_base=base)


def test_tiles_must_be_powers_of_two_of_at_least_16(moe):
    for bad in (dict(block_m=8), dict(down_n=48), dict(gate_up_k=0)):
        with pytest.raises(ValueError):
            moe.Tiles(**bad)


def test_bench_case_runs_under_the_interpreter(moe):
    """benchmarks/kernels_bench.py's fused-MoE case end to end on small shapes, with stand-ins for the CUDA timer
    and the profiler's launch count."""
    from tests.test_kernels_bench import load_bench

    bench = load_bench()
    timer = lambda fn, inputs: [fn(*a) for a in inputs] and 10.0                        # noqa: E731
    counter = lambda fn, args: bench.per_call(Counter({"kernel": 3}), Counter(), calls=1)   # noqa: E731
    case = bench.moe_case(6, 5, 12, device="cpu", timer=timer, counter=counter, hidden=64, inter=32, top_k=2)
    assert case["check"]["ok"] and case["unique_experts"] == 5 and case["pairs"] == 12
    assert case["weight_bytes"] == 5 * 3 * 64 * 32 * 2
    assert case["fused_gbps"] == pytest.approx(case["weight_bytes"] / 10e-6 / 1e9)
    assert case["floor_us"] == pytest.approx(case["weight_bytes"] / 4300e9 * 1e6)
    json.dumps(case)


def test_mapped_bench_case_runs_under_the_interpreter(moe):
    """kernels_bench.py's mapped case: outputs with misses read from the store equal those with every expert in a
    slot, with or without capturing them into free slots (which then hold their blobs), and its bandwidth figures
    come from the timer's numbers."""
    from tests.test_kernels_bench import load_bench

    bench = load_bench()
    times = iter([10.0, 14.0, 15.0, 2.0])        # resident, mapped, captured, copy
    timer = lambda fn, inputs: [fn(*a) for a in inputs] and next(times)                 # noqa: E731
    counter = lambda fn, args: bench.per_call(Counter({"kernel": 3}), Counter(), calls=1)   # noqa: E731
    case = bench.mapped_case(2, device="cpu", timer=timer, counter=counter, tokens=4, unique=4, experts=16,
                             hidden=32, inter=16, top_k=2)
    assert case["check"]["ok"] and case["mapped_experts"] == 2
    assert case["mapped_bytes"] == 2 * 3 * 32 * 16 * 2
    assert case["mapped_gbps"] == pytest.approx(case["mapped_bytes"] / 4e-6 / 1e9)
    assert case["copy_then_resident_us"] == 12.0 and case["capture_extra_us"] == 1.0
    assert case["check"]["captured_equal"] and case["check"]["captured_slots_hold_blobs"]
    json.dumps(case)


# ---------------------------------------------------------------------------------------------------------------
# in the engine


@pytest.mark.parametrize("policy,budget", [("full", "1.0"), ("lru", "0.5")])
def test_fused_moe_in_the_engine_gives_the_same_tokens(moe, monkeypatch, policy, budget):
    """--fused-moe: the manager's grouped computes (the static path; offloaded, the hits and the first wave's
    loads, written straight into the pair rows) run the kernels, and the tokens are the torch path's (fp32, a
    random tiny model)."""
    import oled
    from oled.decoding.params import DecodeParams

    calls = []
    kernel = moe.module.fused_swiglu_pairs
    monkeypatch.setattr(moe.module, "fused_swiglu_pairs", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    tokens = {}
    for fused_moe in (False, True):
        llm = oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy=policy, expert_budget=budget,
                       fused_moe=fused_moe)
        ids = llm.tokenizer.encode("def fib(n):\n")
        tokens[fused_moe] = llm.engine.generate_ids(ids, DecodeParams(gen_length=16, block_length=16)).token_ids
        assert bool(calls) == fused_moe
        if policy == "lru":                                   # misses: first waves loaded and computed
            assert llm.engine.manager.stats.summary()["hit_rate_tokens"] < 1.0
    assert tokens[True] == tokens[False] and len(tokens[True]) == 16


@pytest.mark.parametrize("dtype,weights_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("tokens,k,hidden", [(1, 1, 64), (5, 4, 96), (9, 8, 1536)])     # 1536: two column tiles
def test_combine_equals_the_managers_torch_combine(moe, dtype, weights_dtype, tokens, k, hidden):
    """combine_pairs: the weighted sum of each token's pairs, as ExpertCompute.combine computes it in torch (fp32
    sums in routing order, one rounding), with and without the shared expert's output added (a second rounding);
    bf16 weights (LLaDA-MoE's) are widened as torch widens them."""
    from oled.runtime.compute import ExpertCompute

    g = torch.Generator().manual_seed(tokens * hidden + k)
    y = torch.randn(tokens * k, hidden, generator=g).to(dtype)
    weights = torch.rand(tokens, k, generator=g).to(weights_dtype)
    shared_out = torch.randn(tokens, hidden, generator=g).to(dtype)
    manager = SimpleNamespace(fused_combine=None)
    for add in (None, shared_out):
        ref = ExpertCompute.combine(manager, y, weights, add)
        got = moe.module.combine_pairs(y, weights, add)
        assert got.dtype == dtype and got.shape == (tokens, hidden)
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        else:       # the fp32 sum's order may differ from torch's reduction, by an fp32 ulp: rarely a bf16 ulp
            assert (got != ref).float().mean().item() < 0.01
            torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=2**-7)


def test_combine_refuses_mismatched_shapes(moe):
    with pytest.raises(ValueError, match="y_pairs must be"):
        moe.module.combine_pairs(torch.randn(6, 8), torch.rand(2, 4))
