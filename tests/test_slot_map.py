"""The device slot map (runtime/device_state.py): a layer's hits are computed from it before the host decides anything,
so it must agree with the host's slot tables after every layer, list only experts whose copies the compute waited
for, and leave the host nothing to compute when nothing misses (CPU tensors stand in for the GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import oled

PROMPT = "hello world, how are you today?"


def make_llm(policy, budget):
    return oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy=policy, expert_budget=budget)


def host_row(manager, layer) -> np.ndarray:
    row = np.full(manager.config.num_experts, -1, dtype=np.int64)
    for e, s in manager.cache.resident(layer).items():
        if s not in manager.slots.pending_copy:
            row[e] = s
    return row


@pytest.mark.parametrize("policy,budget", [("lru", "0.25"), ("lru", "0.0625"), ("prefetch", "0.25"),
                                           ("tide", "0.25"), ("oled", "0.25"), ("oled-retain", "0.0625")])
def test_the_device_slot_map_agrees_with_the_host_tables_after_every_layer(policy, budget):
    llm = make_llm(policy, budget)
    m = llm.engine.manager
    end, checked = m.round_trip.finish, []

    def checking_end(work, x, y_pairs):
        end(work, x, y_pairs)
        for layer in m.layers:           # this layer's row and the next one's (a prefetch writes it)
            pos = m.layer_pos[layer]
            assert np.array_equal(m.slots.slot_map[pos].numpy(), host_row(m, layer)), (layer, work.layer)
            assert np.array_equal(m.slots.ready[pos], host_row(m, layer))
        checked.append(work.layer)
    m.round_trip.finish = checking_end
    reference = make_llm("full", "1.0").generate(PROMPT, gen_length=48).token_ids
    assert llm.generate(PROMPT, gen_length=48).token_ids == reference
    assert len(checked) >= 2 * len(m.layers)
    assert m.stats.summary()["hit_rate_tokens"] < 1.0        # there were misses to keep the map busy


def test_a_budget_that_holds_every_expert_runs_the_all_resident_forward():
    """At 100 % every expert is placed at the start, whatever the policy: the forward is the all-resident one (no
    host step per layer), the tokens are full's, and the policy is asked nothing about a layer (no decision could
    load or evict) nor of a forward or an iteration, while every layer's statistics are recorded after the forward,
    as full's are."""
    llm = make_llm("oled", "1.0")
    m = llm.engine.manager
    assert m.all_resident and all(len(m.cache.resident(layer)) == m.config.num_experts for layer in m.layers)
    calls = {"decide_offloaded": 0, "policy": 0}

    def counting(owner, name, key):
        inner = getattr(owner, name)

        def counted(*a):
            calls[key] += 1
            return inner(*a)
        setattr(owner, name, counted)
    counting(m.round_trip, "decide", "decide_offloaded")
    for name in ("decide", "on_forward", "on_iteration"):
        counting(m.policy, name, "policy")
    out = llm.generate(PROMPT, gen_length=48)
    full = make_llm("full", "1.0")
    reference = full.generate(PROMPT, gen_length=48)
    assert out.token_ids == reference.token_ids
    assert calls["decide_offloaded"] == 0 and calls["policy"] == 0
    assert len(m.stats.records) == len(full.engine.manager.stats.records) > 0
    assert m.stats.to_rows() == full.engine.manager.stats.to_rows()
    summary = m.stats.summary()
    assert summary["hit_rate_tokens"] == 1.0 and summary["h2d_gb_per_iteration"] == 0


def test_the_all_resident_host_work_runs_behind_the_next_forward_and_in_order():
    """Inside a request (manager.overlapped) an all-resident forward's host work (its start and its routing's
    records) is done once the next forward is queued: while a forward runs, one forward fewer has been started than
    without the overlap; the host work, its order, the statistics and the tokens are the same."""
    import contextlib

    def run(overlap: bool):
        llm = make_llm("lru", "1.0")
        m, residency = llm.engine.manager, llm.engine.manager.residency
        seen, during = [], []
        for name in ("begin_resident_forward", "record_resident"):
            inner = getattr(residency, name)

            def wrapped(*a, inner=inner, name=name):
                seen.append((name, a[0] if name == "record_resident" else None))
                return inner(*a)
            setattr(residency, name, wrapped)
        model_run = llm.engine.model.run

        def counting_run(*a, **k):
            during.append(sum(1 for name, _ in seen if name == "begin_resident_forward"))
            return model_run(*a, **k)
        llm.engine.model.run = counting_run
        if not overlap:
            m.overlapped = contextlib.nullcontext
        out = llm.generate(PROMPT, gen_length=48)
        return out.token_ids, seen, during, m.stats.to_rows()

    tokens, seen, during, rows = run(True)
    tokens_now, seen_now, during_now, rows_now = run(False)
    assert tokens == tokens_now and seen == seen_now and rows == rows_now
    assert len(during) == len(during_now) > 3 and during_now[0] == 1
    assert during == [n - 1 for n in during_now]         # this forward's start still queued


def test_nothing_missing_means_no_wave_after_the_hits():
    """With every expert resident the hits computed from the device slot map are the whole layer: no first-wave
    compute, no slot buffer written, no row of the map copied (the offloaded path, which 100 % does not take)."""
    llm = make_llm("lru", "1.0")
    m = llm.engine.manager
    m.all_resident = False
    calls = {"load_wave": 0}
    load_wave = m.round_trip.load_wave

    def counting_wave(*a):
        calls["load_wave"] += 1
        return load_wave(*a)
    m.round_trip.load_wave = counting_wave
    out = llm.generate(PROMPT, gen_length=48)
    reference = make_llm("full", "1.0").generate(PROMPT, gen_length=48).token_ids
    assert out.token_ids == reference
    assert calls["load_wave"] == 0


def test_an_expert_whose_copy_was_not_waited_for_is_computed_after_the_wait():
    """A prefetched expert's copy may still run when its layer starts: the map leaves it out (the hits computed
    before the host would read a half-copied slot), and the first wave computes it once the compute waited."""
    llm = make_llm("full", "1.0")                 # every expert resident from the start
    m = llm.engine.manager
    layer = m.layers[0]
    expert, slot = next(iter(m.cache.resident(layer).items()))
    m.slots.pending_copy[slot] = object()          # a copy in flight (issued by _copy, which marks the layer changed)
    m.slots.changed.add(layer)
    m.slots.sync(layer)
    assert m.slots.slot_map[m.layer_pos[layer]][expert] == -1
    del m.slots.pending_copy[slot]                 # waited for (by _issue_wave, which marks it too)
    m.slots.changed.add(layer)
    m.slots.sync(layer)
    assert m.slots.slot_map[m.layer_pos[layer]][expert] == slot


def test_a_hit_left_out_of_the_map_is_computed_in_the_first_wave():
    """The same on a whole layer: its hits that the map leaves out land in the first wave's slots, and the layer's
    output equals the all-resident one."""
    llm = make_llm("lru", "1.0")
    m = llm.engine.manager
    m.all_resident = False                         # the offloaded path, with every expert resident
    layer = m.layers[0]
    torch.manual_seed(0)
    x = torch.randn(4, m.hidden)
    ids = torch.stack([torch.randperm(m.config.num_experts)[:m.config.top_k] for _ in range(4)])
    weights = torch.rand(4, m.config.top_k)
    with torch.inference_mode():
        expected = m.run(layer, x, ids, weights)
    pos = m.layer_pos[layer]
    left_out = int(ids[0, 0])
    m.slots.ready[pos, left_out] = -1                  # as if its copy had not been waited for when the layer started
    m.slots.slot_map[pos, left_out] = -1
    waves = []
    load_wave = m.round_trip.load_wave
    m.round_trip.load_wave = lambda *a: (waves.append(a[2].clone()), load_wave(*a))
    with torch.inference_mode():
        assert torch.equal(m.run(layer, x, ids, weights), expected)
    assert len(waves) == 1
    served = waves[0].reshape(4, -1) >= 0
    assert served.equal(ids == left_out)           # exactly the pairs of the left-out hit
    assert m.slots.slot_map[pos, left_out] >= 0          # listed again once computed
