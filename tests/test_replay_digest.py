"""benchmarks/replay_digest.py: one digest per replayed run, equal when the decisions are equal and different when
they are not (the check a host-side refactor runs before and after)."""
from __future__ import annotations

from pathlib import Path

import pytest

from .scripts import benchmark_script

ROOT = Path(__file__).parents[1]
TRACE = ROOT / "tests" / "data" / "tiny-code.trace"
COSTS = ROOT / "benchmarks" / "results" / "h200" / "s34" / "call4" / "grid" / "results.jsonl.gz"


def digests(tmp_path, name, policies, budgets="0.4,0.25"):
    out = tmp_path / name
    assert benchmark_script("replay_digest").main([str(TRACE), str(COSTS), "--policies", policies,
                                                   "--budgets", budgets, "--out", str(out)]) == 0
    return {tuple(line.split()[:3]): line.split()[3] for line in out.read_text().splitlines()}


def test_digests_repeat_and_tell_decisions_apart(tmp_path):
    first = digests(tmp_path, "a", "lru,oled")
    assert len(first) == 2 * 2 * 3                            # policies x budgets x host paths
    assert digests(tmp_path, "b", "lru,oled") == first         # the same decisions, the same digests
    for budget in ("0.4", "0.25"):                             # different policies decide differently
        assert first["lru", budget, "round-trip"] != first["oled", budget, "round-trip"]
    assert first["lru", "0.4", "round-trip"] != first["lru", "0.25", "round-trip"]


def test_counters_left_out_for_an_older_commit(tmp_path):
    script = benchmark_script("replay_digest")
    out = tmp_path / "without"
    assert script.main([str(TRACE), str(COSTS), "--policies", "lru", "--budgets", "0.4", "--out", str(out),
                        "--without-counters", "loads_used"]) == 0
    without = {tuple(line.split()[:3]): line.split()[3] for line in out.read_text().splitlines()}
    full = digests(tmp_path, "all", "lru", budgets="0.4")
    assert without.keys() == full.keys() and all(without[k] != full[k] for k in full)
    with pytest.raises(SystemExit) as e:
        script.main([str(TRACE), str(COSTS), "--without-counters", "no_such_counter"])
    assert e.value.code == 2
