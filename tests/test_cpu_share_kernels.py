"""The CPU's share of a mapped MoE call in the fused kernels (oled/kernels/triton_moe.py `CpuShare`), under Triton's
interpreter: the alignment gives the CPU the experts the host's rule names (oled/runtime/cpu_share.py), leaves their
rows to it, hands it their tokens' inputs, resets the host's mark and stores the routing; the combine takes the CPU's
rows, rounded as the GPU's, and counts an error where the host's mark is missing."""
from __future__ import annotations

import pytest
import torch

from oled.runtime.cpu_share import cpu_share_experts
from tests.test_triton_moe import SENTINEL, capture_call, fused, moe, partly_resident  # noqa: F401  (fixture)


def share_buffers(moe, tokens, k, hidden, experts, table, dtype, capacity=0):
    return moe.module.CpuShare(capacity=capacity,
        table=torch.tensor(table, dtype=torch.int32), x_rows=torch.full((tokens, hidden), SENTINEL, dtype=dtype),
        pair_on_cpu=torch.full((tokens * k,), 7, dtype=torch.int32), done=torch.ones(1, dtype=torch.int32),
        row_of_pair=torch.full((tokens * k,), -1, dtype=torch.int32),
        rows=torch.full((tokens * k, hidden), float("nan")), errors=torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("cpu_of_m", [0, 1, 2, 100], ids=["none", "one", "two", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_takes_the_highest_id_misses_and_the_combine_their_rows(moe, cpu_of_m, dtype):
    """With table[m] = cpu_of_m: the pairs of the min(cpu_of_m, m) highest-id misses are marked and their rows of
    out left untouched, every other row is the plain mapped call's; x_rows holds exactly the rows of tokens with a
    CPU pair; done is reset to 0; the routing is stored. Once the host writes those pairs' outputs (here: the plain
    call's own rows, in a scrambled order of rows) and sets done, the combine equals the plain call's combine, bit
    for bit, with no error."""
    experts, hidden, inter, base, resident, tokens, k = 12, 32, 16, 3, 4, 6, 3
    ids, store, x, held, slot_map = partly_resident(experts, hidden, inter, base, resident, tokens, k, dtype, seed=31)
    pool = store[held]
    table = [min(m, cpu_of_m) for m in range(experts + 1)]
    share = share_buffers(moe, tokens, k, hidden, experts, table, dtype)
    weights = torch.rand(tokens, k, generator=torch.Generator().manual_seed(2))
    dst, dst_plain = (torch.full((tokens, 3 * k), -1, dtype=torch.int32) for _ in range(2))
    kw = dict(slot_base=base, slot_map=slot_map, host=store)
    plain = fused(moe, x, ids, pool, hidden, inter, routing=(weights, dst_plain), **kw)
    got = fused(moe, x, ids, pool, hidden, inter, routing=(weights, dst), cpu_share=share, **kw)

    misses = sorted(set(ids[slot_map[ids] < 0].tolist()))
    assert len(misses) >= 3, "the test needs misses"
    demanded = len(set(ids.tolist()))
    cpu = cpu_share_experts(misses, table, demanded, 0)
    assert cpu == misses[len(misses) - min(cpu_of_m, len(misses)):] if cpu_of_m else cpu == []
    on_cpu = torch.tensor([int(e) in cpu for e in ids.tolist()])
    assert torch.equal(share.pair_on_cpu, on_cpu.to(torch.int32))
    assert (got[on_cpu] == SENTINEL).all() and torch.equal(got[~on_cpu], plain[~on_cpu])
    token_has_cpu = on_cpu.view(tokens, k).any(1)
    assert torch.equal(share.x_rows[token_has_cpu], x[token_has_cpu])
    assert (share.x_rows[~token_has_cpu] == SENTINEL).all()
    assert share.done.item() == 0 and torch.equal(dst, dst_plain)

    pairs = torch.nonzero(on_cpu).flatten()
    order = pairs.flip(0)                                  # rows in any order: row_of_pair says where
    share.rows[: len(order)] = plain[order].float()
    share.row_of_pair[order] = torch.arange(len(order), dtype=torch.int32)
    share.done.fill_(1)
    combined = moe.module.combine_pairs(got, weights, cpu_share=share)
    assert torch.equal(combined, moe.module.combine_pairs(plain, weights))
    assert share.errors.item() == 0


def test_the_cpu_rows_are_rounded_to_the_models_dtype(moe):
    """A CPU row is fp32; the combine rounds it to bf16 first, as the GPU stores a pair's output."""
    tokens, k, hidden = 2, 2, 64
    y = torch.randn(tokens * k, hidden).to(torch.bfloat16)
    fine = torch.randn(tokens * k, hidden)                 # not representable in bf16
    weights = torch.rand(tokens, k)
    share = moe.module.CpuShare(
        table=torch.zeros(1, dtype=torch.int32), x_rows=torch.zeros(tokens, hidden, dtype=torch.bfloat16),
        pair_on_cpu=torch.tensor([0, 1, 1, 0], dtype=torch.int32), done=torch.ones(1, dtype=torch.int32),
        row_of_pair=torch.tensor([-1, 0, 1, -1], dtype=torch.int32), rows=fine[[1, 2]].clone(),
        errors=torch.zeros(1, dtype=torch.int32))
    want = y.clone()
    want[[1, 2]] = fine[[1, 2]].to(torch.bfloat16)
    assert torch.equal(moe.module.combine_pairs(y, weights, cpu_share=share), moe.module.combine_pairs(want, weights))


@pytest.mark.parametrize("spare", [0, 1, 2, 5])
def test_only_misses_the_slots_cannot_keep_go_to_the_cpu(moe, spare):
    """With capacity slots, the CPU takes at most d - capacity of the misses (d: the experts the call computes),
    the ones the loads after the forward could not keep beside the hits: the host's rule, pair for pair."""
    experts, hidden, inter, base, resident, tokens, k = 12, 32, 16, 3, 4, 6, 3
    ids, store, x, held, slot_map = partly_resident(experts, hidden, inter, base, resident, tokens, k, torch.float32,
                                                    seed=31)
    demanded = len(set(ids.tolist()))
    table = [m for m in range(experts + 1)]               # as many as the limit allows
    share = share_buffers(moe, tokens, k, hidden, experts, table, torch.float32, capacity=demanded - spare)
    weights = torch.rand(tokens, k)
    dst = torch.full((tokens, 3 * k), -1, dtype=torch.int32)
    fused(moe, x, ids, store[held], hidden, inter, slot_base=base, slot_map=slot_map, host=store,
          routing=(weights, dst), cpu_share=share)
    misses = sorted(set(ids[slot_map[ids] < 0].tolist()))
    cpu = cpu_share_experts(misses, table, demanded, demanded - spare)
    assert len(cpu) == min(spare, len(misses))
    assert torch.equal(share.pair_on_cpu, torch.tensor([int(e) in cpu for e in ids.tolist()], dtype=torch.int32))


def test_a_missing_mark_is_counted_as_an_error(moe):
    """done still 0 when the combine runs (the host never answered): each program with a CPU pair adds 1 to errors,
    the one without does not (under the interpreter there is no wait: the host has answered before, or never)."""
    tokens, k, hidden = 3, 2, 2048                        # two column tiles a token
    share = moe.module.CpuShare(
        table=torch.zeros(1, dtype=torch.int32), x_rows=torch.zeros(tokens, hidden),
        pair_on_cpu=torch.tensor([0, 1, 0, 0, 1, 1], dtype=torch.int32), done=torch.zeros(1, dtype=torch.int32),
        row_of_pair=torch.tensor([-1, 0, -1, -1, 1, 2], dtype=torch.int32), rows=torch.zeros(3, hidden),
        errors=torch.zeros(1, dtype=torch.int32))
    moe.module.combine_pairs(torch.randn(tokens * k, hidden), torch.rand(tokens, k), cpu_share=share)
    assert share.errors.item() == 2 * 2                    # tokens 0 and 2, two tiles each


def test_the_cpu_share_is_never_captured(moe):
    """With capture as well, the captured slots take the GPU's misses in increasing id, never a CPU expert: the
    rule the host's decide_mapped applies."""
    experts, hidden, inter, base, resident, tokens, k, free = 12, 32, 16, 3, 4, 6, 3, 6
    ids, store, x, held, slot_map = partly_resident(experts, hidden, inter, base, resident, tokens, k, torch.float32,
                                                    seed=31)
    pool = torch.cat([store[held], torch.full((free, store.shape[1]), SENTINEL)])
    capture = torch.arange(free, dtype=torch.int64) + base + resident
    table = [min(m, 2) for m in range(experts + 1)]
    share = share_buffers(moe, tokens, k, hidden, experts, table, torch.float32)
    weights = torch.rand(tokens, k)
    dst = torch.full((tokens, 3 * k), -1, dtype=torch.int32)
    captured_pool = pool.clone()
    fused(moe, x, ids, captured_pool, hidden, inter, slot_base=base, slot_map=slot_map, host=store, capture=capture,
          routing=(weights, dst), cpu_share=share)
    misses = sorted(set(ids[slot_map[ids] < 0].tolist()))
    gpu = [e for e in misses if e not in cpu_share_experts(misses, table, len(set(ids.tolist())), 0)]
    assert len(gpu) < free and len(misses) > len(gpu)
    for i, e in enumerate(gpu):
        assert torch.equal(captured_pool[resident + i], store[e])
    assert (captured_pool[resident + len(gpu):] == SENTINEL).all()


def test_a_cpu_share_needs_the_mapped_call_and_its_routing(moe):
    experts, hidden, inter, base, resident, tokens, k = 12, 32, 16, 3, 4, 6, 3
    ids, store, x, held, slot_map = partly_resident(experts, hidden, inter, base, resident, tokens, k, torch.float32,
                                                    seed=31)
    share = share_buffers(moe, tokens, k, hidden, experts, [0] * (experts + 1), torch.float32)
    with pytest.raises(ValueError, match="cpu_share needs"):
        fused(moe, x, ids, store[held], hidden, inter, slot_base=base, slot_map=slot_map, host=store, cpu_share=share)
