"""The cost model's measurement rules (runtime/cost_model.py) that do not need a GPU."""


def test_cpu_times_never_fall_as_tokens_grow():
    """A figure measured at few tokens above one at more tokens is noise (the routing grid's 0.81 ms at 1 token
    against 0.06 ms at 4): it is lowered to the smallest figure at any larger token count."""
    from oled.runtime.cost_model import monotone_in_tokens

    measured = {1: 812e-6, 2: 275e-6, 4: 60e-6, 8: 266e-6, 16: 265e-6, 32: 462e-6}
    fixed = monotone_in_tokens(measured)
    assert fixed == {1: 60e-6, 2: 60e-6, 4: 60e-6, 8: 265e-6, 16: 265e-6, 32: 462e-6}
    assert monotone_in_tokens(fixed) == fixed


class _FakeLoad:
    """Stands in for _CopyLoad: its copies outlast the timing once they last `needed` seconds or more."""
    made: list[float] = []

    def __init__(self, store, device, h2d, seconds, needed):
        self.seconds, self.needed = seconds, needed
        _FakeLoad.made.append(seconds)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.outlasted = self.seconds >= self.needed
        return False


def _slowdown(monkeypatch, needed: float, busy_times: list[float], pinned: bool = True) -> float:
    from types import SimpleNamespace

    from oled.runtime import cost_model

    _FakeLoad.made = []
    times = iter(busy_times)
    monkeypatch.setattr(cost_model, "_CopyLoad", lambda *a: _FakeLoad(*a, needed=needed))
    monkeypatch.setattr(cost_model, "calibrate", lambda *a, **k: {4: next(times)})
    store = SimpleNamespace(pinned=pinned, hidden=8, intermediate=4, dtype=None, expert_dtype="bf16")
    return cost_model._cpu_slowdown_with_copies(store, None, "cuda", 50.0, alone_s=1e-4, jobs=8)


def test_the_cpu_slowdown_beside_copies_counts_only_rounds_the_copies_outlasted(monkeypatch):
    """Version 9: a round whose copies ended before the CPU timing did is discarded and the copies' length doubled;
    the slowdown is the least of ROUNDS kept rounds over the time alone, never below 1."""
    from oled.runtime.cost_model import ROUNDS

    # copies of 0.5 s and 1 s end too early; from 2 s on every round counts
    slowdown = _slowdown(monkeypatch, needed=2.0, busy_times=[9e-4, 9e-4, 1.5e-4, 1.3e-4, 1.4e-4])
    assert _FakeLoad.made == [0.5, 1.0] + [2.0] * ROUNDS
    assert abs(slowdown - 1.3) < 1e-9
    assert _slowdown(monkeypatch, needed=0.5, busy_times=[0.5e-4] * ROUNDS) == 1.0      # faster beside: 1


def test_the_cpu_slowdown_search_is_bounded_and_unpinned_copies_never_overlap(monkeypatch):
    """Copies that never outlast the timing end the search at 8 s with a slowdown of 1 (and a warning); an unpinned
    store's copies block the host, so nothing overlaps and nothing is timed."""
    assert _slowdown(monkeypatch, needed=1e9, busy_times=[1e-3] * 10) == 1.0
    assert _FakeLoad.made == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert _slowdown(monkeypatch, needed=0.5, busy_times=[], pinned=False) == 1.0 and _FakeLoad.made == []


def test_a_cost_model_is_read_from_its_json_or_from_bench_results_plain_or_gzipped(tmp_path):
    import gzip
    import json

    import pytest

    from oled.runtime.cost_model import CostModel

    from .costs import balanced_costs

    model = balanced_costs(6 * 2**20)
    (tmp_path / "costs.json").write_text(model.to_json())
    lines = [json.dumps({"status": "ok"}), json.dumps({"status": "ok", "cost_model": model.to_dict()})]
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    with gzip.open(tmp_path / "results.jsonl.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    for name in ("costs.json", "results.jsonl", "results.jsonl.gz"):
        assert CostModel.from_file(tmp_path / name).to_dict() == model.to_dict()
    (tmp_path / "none.jsonl").write_text(lines[0] + "\n")
    with pytest.raises(ValueError, match="no line carries a cost model"):
        CostModel.from_file(tmp_path / "none.jsonl")
