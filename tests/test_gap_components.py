"""benchmarks/gap_components.py: a policy's time above the bound split into its misses (retention) and how it
serves them (service), on a learned-routing grid's rows."""
from __future__ import annotations

from pathlib import Path

import pytest

from oled.bounds import CostTable, Demand, misses_seconds
from oled.runtime.cost_model import CostModel
from oled.trace import Trace, replay

from .scripts import benchmark_script

ROOT = Path(__file__).parents[1]
TRACE = ROOT / "tests" / "data" / "tiny-code.trace"
COSTS = ROOT / "benchmarks" / "results" / "h200" / "s34" / "call4" / "grid" / "results.jsonl.gz"


def row(policy, budget, mode, **metrics):
    name = policy if policy.startswith("bound:") else policy.split(":")[0]
    return {"policy": name, "policy_label": policy, "budget": budget, "mode": mode,
            "metrics": {k: {"median": v} for k, v in metrics.items()}}


def test_the_components_add_up_to_the_gap_and_follow_the_replayed_misses():
    gaps = benchmark_script("gap_components")
    trace, costs = Trace.load(TRACE), CostModel.from_file(COSTS)
    rows = [row("full", "1.0", "live", ms_per_forward=2.0, tpot_ms=2.5),
            row("lru", "0.25", "live", tpot_ms=9.0, misses_per_iteration=30.0),
            row("oled", "0.25", "live", tpot_ms=8.0, misses_per_iteration=25.0),
            row("bound:demand-link-shared", "0.25", "bound", tpot_ms=4.0)]
    out = {o["policy"]: o for o in gaps.components(trace, rows, costs, ["0.25"], "shared")}
    assert set(out) == {"lru", "oled"}
    demand = Demand.from_trace(trace)
    table = CostTable.from_cost_model(costs, 2.0 / 1e3 / len(demand.layers), demand.max_tokens, "test")
    for name, measured in (("lru", 9.0), ("oled", 8.0)):
        o = out[name]
        assert o["retention_ms"] + o["service_ms"] == pytest.approx(measured - 4.0)
        records = replay(trace, name, "0.25", costs).stats.records
        misses = [r.experts - r.experts_hit for r in records]
        assert o["own_misses_at_bound_ms"] == pytest.approx(misses_seconds(demand, misses, table) * 1e3 / demand.tokens)
        assert o["replayed_misses_per_iteration"] > 0


def test_a_grid_without_full_or_the_bound_is_refused_with_one_line(tmp_path, capsys):
    gaps = benchmark_script("gap_components")
    with pytest.raises(ValueError, match="no live `full` row"):
        gaps.components(Trace.load(TRACE), [row("lru", "0.25", "live", tpot_ms=1.0)], CostModel.from_file(COSTS),
                        ["0.25"], "shared")
    with pytest.raises(ValueError, match="no bound:demand-link-even row"):
        gaps.components(Trace.load(TRACE), [row("full", "1.0", "live", ms_per_forward=1.0)],
                        CostModel.from_file(COSTS), ["0.25"], "even")
    assert gaps.main(["--trace", str(TRACE), "--grid", str(tmp_path / "missing.jsonl")]) == 2
    assert "gap_components:" in capsys.readouterr().err
