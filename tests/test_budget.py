"""The expert budget: parsing (fractions, percentages, sizes), refusals with one clear line, and the GPU fit check."""
from __future__ import annotations

import pytest
import torch

import oled
from oled.cli import main as cli_main
from oled.engine import Engine
from oled.runtime.budget import BudgetError, ExpertBudget, parse_budget

L, E, EB = 2, 16, 24576          # the tiny preset: 2 MoE layers, 16 experts, 24 KiB fp32 experts
TOTAL = L * E * EB


def budget(spec, num_layers=L, num_experts=E, expert_bytes=EB) -> ExpertBudget:
    return parse_budget(spec, num_layers=num_layers, num_experts=num_experts, expert_bytes=expert_bytes)


@pytest.mark.parametrize("spec,slots", [
    ("1.0", 16), ("1", 16), (1.0, 16), ("0.5", 8), (0.25, 4), ("0.0625", 1), (".5", 8), ("5e-1", 8),
    ("0.49", 7),                                   # rounded down: a budget is a ceiling
    ("50%", 8), ("25 %", 4), ("100%", 16), ("6.25%", 1),
    (f"{TOTAL}", None), (f"{TOTAL}B", 16), (f"{TOTAL // 2}b", 8), ("96KiB", 2), ("96kib", 2), ("0.09375MiB", 2),
    ("98.304kB", 2), ("768KiB", 16), (" 0.5 ", 8),
])
def test_parse(spec, slots):
    if slots is None:   # a bare number above 1 is not a size: refused (see test_bare_number_above_one)
        with pytest.raises(BudgetError):
            budget(spec)
        return
    b = budget(spec)
    assert b.slots_per_layer == slots
    assert b.slots == slots * L
    assert b.bytes == slots * L * EB <= max(TOTAL, b.bytes)
    assert b.fraction == pytest.approx(slots / E)
    assert f"{slots} of {E} experts per layer" in b.describe()


def test_decimal_fractions_do_not_lose_a_slot_to_rounding():
    # 0.29 * 100 is 28.999999999999996 in floating point; the budget must still give 29 slots.
    for spec in ("0.29", "29%", "0.57", "57%", "0.58"):
        want = round(float(spec.rstrip("%")) * (100 if "%" not in spec else 1))
        assert budget(spec, num_layers=1, num_experts=100, expert_bytes=1).slots_per_layer == want, spec


@pytest.mark.parametrize("spec", ["1.5", "2", "12", "100"])
def test_bare_number_above_one(spec):
    with pytest.raises(BudgetError) as err:
        budget(spec)
    msg = str(err.value)
    assert "\n" not in msg and "at most 1" in msg and "%" in msg and "GiB" in msg


@pytest.mark.parametrize("spec", ["150%", "100.5%", "999GiB", f"{TOTAL + 1}B"])
def test_above_all_experts_refused_like_a_bare_two(spec):
    with pytest.raises(BudgetError) as err:
        budget(spec)
    msg = str(err.value)
    assert "\n" not in msg and ("more than all the routed experts take" in msg and "1.0 (or 100%)" in msg
                                 or "must be at most 100%" in msg)


@pytest.mark.parametrize("spec", ["", "abc", "-0.5", "0.5x", "12 parsecs", "1/2"])
def test_unparsable(spec):
    with pytest.raises(BudgetError) as err:
        budget(spec)
    assert "\n" not in str(err.value) and "fraction" in str(err.value)


@pytest.mark.parametrize("spec", ["0", "0.0", "0.06", "6%", "47KiB", "1000B", "49151B"])
def test_too_small_names_the_minimum(spec):
    with pytest.raises(BudgetError) as err:
        budget(spec)
    msg = str(err.value)
    assert "\n" not in msg
    assert "too small" in msg and "one expert slot per MoE layer" in msg
    assert f"{L * EB / 2**20:.1f} MiB" in msg           # the minimum, in bytes ...
    assert f"{1 / E:.2%}" in msg                        # ... and as a share of the routed experts


def test_minimum_is_accepted():
    assert budget(f"{L * EB}B").slots_per_layer == 1
    assert budget(f"{100 / E}%").slots_per_layer == 1
    assert budget("1", num_layers=1, num_experts=1, expert_bytes=1).slots_per_layer == 1


def test_budget_error_is_a_value_error():
    assert issubclass(BudgetError, ValueError)       # the CLI turns ValueError into one line and exit code 2


def test_llm_refuses_too_small_budget():
    with pytest.raises(BudgetError, match="too small"):
        oled.LLM(random_weights="tiny", expert_budget="0.05", policy="lru")
    with pytest.raises(BudgetError, match="at most 1"):
        oled.LLM(random_weights="tiny", expert_budget="2", policy="lru")


def test_engine_budget_reflects_the_model():
    llm = oled.LLM(random_weights="tiny", expert_budget="25%", policy="lru")
    eng = llm.engine
    assert eng.budget.slots_per_layer == 4 and eng.budget.num_layers == len(eng.config.moe_layers)
    assert eng.manager.cache.capacity == 4
    assert eng.manager.cache.pool.shape[0] == eng.budget.slots       # the pool holds exactly the budget
    assert eng.manager.cache.pool.numel() * eng.manager.cache.pool.element_size() == eng.budget.bytes


def test_full_policy_needs_the_whole_budget():
    with pytest.raises(ValueError, match="expert-budget 1.0"):
        oled.LLM(random_weights="tiny", expert_budget="0.5", policy="full")


# ------------------------------------------------------------------------------------------- larger than the GPU
def _fake_cuda_engine(spec):
    eng = Engine.__new__(Engine)
    eng.device = torch.device("cuda", 0)
    eng.budget = budget(spec, expert_bytes=2**30)       # 1 GiB experts: 32 GiB for the whole model
    return eng


def test_budget_larger_than_free_gpu_memory_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 80 * 2**30))
    eng = _fake_cuda_engine("0.5")                      # 16 GiB of experts, 10 GiB free
    with pytest.raises(ValueError) as err:
        eng._check_fits()
    msg = str(err.value)
    assert "\n" not in msg and "does not fit" in msg and "16.0 GiB" in msg and "10.0 GiB free" in msg


def test_budget_that_fits_is_accepted(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 80 * 2**30))
    _fake_cuda_engine("0.25")._check_fits()             # 8 GiB of experts, 10 GiB free


def test_fit_check_is_for_gpus_only(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("no CUDA query on a CPU engine")
    monkeypatch.setattr(torch.cuda, "mem_get_info", boom)
    eng = _fake_cuda_engine("1.0")
    eng.device = torch.device("cpu")
    eng._check_fits()


# ------------------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("spec,words", [("0.01", "too small"), ("3", "at most 1"), ("lots", "expected a fraction")])
def test_cli_refuses_with_one_line(spec, words, capsys):
    rc = cli_main(["generate", "hi", "--random-weights", "tiny", "--device", "cpu", "--expert-budget", spec,
                   "--gen-length", "4"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("oled generate: error: expert budget") and words in err
