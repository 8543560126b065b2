"""oled bench: JSON lines with every field, the report from a small fixture, workloads, replay, skips."""
from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest
import torch

from oled.bench import METRICS, BenchConfig, PolicySpec, render, run_bench
from oled.bench import workloads as wl
from oled.config import SETTING_NAMES, EngineConfig
from oled.decoding.params import DecodeParams

from .costs import balanced_costs
from .scripts import benchmark_script

TOP_LEVEL = ("schema", "run_id", "mode", "status", "label", "timestamp", "workload", "policy", "policy_label",
             "policy_options", "budget", "budget_fraction", "slots_per_layer", "budget_bytes", "model", "engine",
             "decode", "bench", "env", "metrics", "sections_per_iteration_ms", "stats_totals", "prompts", "cost_model")
AGGREGATE = ("median", "min", "max", "spread", "values")


def _cfg(tmp_path, **kw):
    """A small grid; engine settings (tide_tau, popularity, ...) given flat go to its EngineConfig."""
    engine = {k: kw.pop(k) for k in list(kw) if k in SETTING_NAMES}
    base = dict(policies=["full", "lru"], budgets=["1.0", "0.5"], workloads=["code"],
                prompts=2, repeats=1, warmup=1, decode=DecodeParams(gen_length=16, block_length=16),
                out=str(tmp_path / "bench"), progress=False)
    base.update(kw)
    return BenchConfig(engine=EngineConfig(**{"random_weights": "tiny", **engine}), **base)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    cfg = _cfg(tmp, policies=["full", "lru", "lfu"], repeats=2)
    return cfg, run_bench(cfg)


def test_json_lines_carry_every_field(live):
    cfg, rows = live
    lines = [json.loads(x) for x in open(f"{cfg.out}/results.jsonl")]
    assert lines == json.loads(json.dumps(rows, default=str))
    # full runs at 100 % only; every other policy at every budget; belady's bounds beside them (no CPU policy ran, so
    # no cost model was measured: misses only, not timed)
    bounds = [(f"bound:belady-{pool}", b) for pool in ("even", "shared") for b in ("0.5", "1.0")]
    bounds += [("bound:lookahead-even", b) for b in ("0.5", "1.0")]
    assert sorted((r["policy"], r["budget"]) for r in lines) == sorted(bounds + [
        ("full", "1.0"), ("lfu", "0.5"), ("lfu", "1.0"), ("lru", "0.5"), ("lru", "1.0")])
    bound = [r for r in lines if r["policy"].startswith("bound:")]
    assert all(r["mode"] == "bound" and r["metrics"]["tpot_ms"]["median"] is None for r in bound)
    misses = {(r["policy"], r["budget"]): r["metrics"]["misses_per_iteration"]["median"] for r in lines}
    for pool in ("even", "shared"):   # 100 %: every expert resident from the start
        assert misses[(f"bound:belady-{pool}", "0.5")] > 0 == misses[(f"bound:belady-{pool}", "1.0")]
        assert misses[(f"bound:belady-{pool}", "0.5")] <= min(misses[("lru", "0.5")], misses[("lfu", "0.5")])
    for r in lines:
        for key in TOP_LEVEL:
            assert key in r, key
    for r in (r for r in lines if r["mode"] != "bound"):
        assert r["label"] == "CPU" and r["mode"] == "live" and r["status"] == "ok"
        assert set(r["metrics"]) == set(METRICS)
        for name, m in r["metrics"].items():
            assert set(AGGREGATE) <= set(m), name
            assert len(m["values"]) == 2                                       # one value per repeat
        env = r["env"]
        assert {"git", "platform", "cpu", "versions", "device", "label", "gpu"} <= set(env)
        assert {"oled", "python", "torch", "numpy"} <= set(env["versions"])
        assert "commit" in env["git"]
        assert r["decode"]["gen_length"] == 16 and r["decode"]["block_length"] == 16
        assert r["engine"]["policy"] == r["policy"] and r["engine"]["expert_budget"] == r["budget"]
        assert r["bench"]["repeats"] == 2 and r["bench"]["reference"] == "full"
        assert r["workload"]["name"] == "code" and r["workload"]["provenance"]["written_by"]
        assert len(r["prompts"]) == 2
        m = {k: v["median"] for k, v in r["metrics"].items()}
        assert m["tpot_ms"] > 0 and m["tokens_per_s"] > 0 and m["nfe"] > 0 and m["tpf"] > 0
        assert m["token_agreement"] == 1.0 and m["identical_outputs"] == 1.0     # offloading is lossless
        assert 0.0 <= m["hit_rate_tokens"] <= 1.0 and 0.0 <= m["cache_utilization"] <= 1.0
    half = next(r for r in lines if r["policy"] == "lru" and r["budget"] == "0.5")
    assert half["metrics"]["hit_rate_tokens"]["median"] < 1.0
    assert half["metrics"]["h2d_gb_per_iteration"]["median"] > 0
    assert half["slots_per_layer"] == 8 and half["budget_fraction"] == 0.5


def test_breakdown_and_report_of_a_live_run(live):
    cfg, rows = live
    profiled = [r for r in rows if r["bench"]["profiled_pass"]]
    assert [(r["policy"], r["budget"]) for r in profiled] == [("lru", "0.5")]   # first non-full, smallest budget
    sec = profiled[0]["sections_per_iteration_ms"]
    assert {"attention", "gpu_experts", "copy_wait", "cpu_experts", "other", "wall"} <= set(sec)
    assert sec["attention"] > 0 and sec["gpu_experts"] > 0
    series = [json.loads(x) for x in open(f"{cfg.out}/iterations.jsonl")]
    assert len(series) == 1 and len(series[0]["series_ms"]["wall"]) > 0
    report = open(f"{cfg.out}/report.md").read()
    assert "## Workload `code`" in report and "Per-iteration time breakdown" in report and "CPU run" in report


def _fixture_rows():
    """A small hand-made result set: one workload, three policies (full at 100 % only), two budgets."""
    def metric(v, spread=0.0):
        return None if v is None else {"median": v, "min": v - spread / 2, "max": v + spread / 2, "spread": spread,
                                       "values": [v - spread / 2, v + spread / 2]}
    rows = []
    for policy, budget, frac, slots, tpot, hit in [("full", "1.0", 1.0, 16, 10.0, 1.0),
                                                   ("lru", "1.0", 1.0, 16, 10.5, 1.0),
                                                   ("lru", "0.5", 0.5, 8, 14.0, 0.7),
                                                   ("oledx", "0.5", 0.5, 8, 12.0, 0.85)]:
        metrics = {k: metric(None) for k in METRICS}
        metrics.update(tpot_ms=metric(tpot, 0.4), tokens_per_s=metric(1e3 / tpot), hit_rate_tokens=metric(hit),
                       hit_rate_experts=metric(hit - 0.05), cache_utilization=metric(0.9),
                       h2d_gb_per_iteration=metric(0.01 * (1 - hit)), cpu_pairs_per_iteration=metric(0.0),
                       token_agreement=metric(1.0), nfe=metric(100), tpf=metric(2.5), prefill_ms=metric(3.0))
        rows.append({
            "schema": "oled-bench/1", "run_id": f"code|{policy}|{budget}", "mode": "live", "status": "ok",
            "label": "CPU", "timestamp": "2026-01-01T00:00:00+00:00",
            "workload": {"name": "code", "source": "code.jsonl", "num_prompts": 2, "prompt_ids": ["a", "b"],
                         "provenance": {"description": "fixture."}},
            "policy": policy, "policy_label": policy, "policy_options": {}, "budget": budget,
            "budget_fraction": frac, "slots_per_layer": slots, "budget_bytes": slots * 100,
            "model": {"name": "fixture", "model_type": "llada2_moe", "num_layers": 3, "moe_layers": 2,
                      "num_experts": 16, "top_k": 4, "expert_bytes": 100, "note": None},
            "engine": {}, "decode": {"gen_length": 16, "block_length": 16, "threshold": 0.95, "cache": "prefix",
                                     "temperature": 0.0},
            "bench": {"repeats": 2, "warmup_prompts": 1, "seed": 0, "reference": "full", "timing": "wall clock (CPU)"},
            "env": {"git": {"commit": "0123456789abcdef", "dirty": False}, "platform": "test",
                    "cpu": {"model": "test cpu", "usable_cpus": 2}, "versions": {"oled": "0", "torch": "x"},
                    "label": "CPU", "gpu": None},
            "metrics": metrics, "sections_per_iteration_ms": None, "stats_totals": {}, "prompts": []})
    series = {"run_id": "code|lru|0.5", "workload": "code", "policy_label": "lru", "budget": "0.5", "label": "CPU",
              "series_ms": {"attention": [1.0, 1.1, 0.9], "gpu_experts": [2.0, 2.1, 1.9], "copy_wait": [0.5, 0, 0.2],
                            "cpu_experts": [0, 0, 0], "other": [1.0, 1.0, 1.0], "wall": [4.5, 4.2, 4.0]}}
    return rows, series


def test_report_renders_from_a_small_fixture(tmp_path):
    rows, series = _fixture_rows()
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "iterations.jsonl").write_text(json.dumps(series) + "\n")
    (tmp_path / "skipped.jsonl").write_text(json.dumps({"workload": "code", "policy": "fiddler",
                                                        "policy_label": "fiddler", "budget": "0.5",
                                                        "reason": "needs a popularity file"}) + "\n")
    report = render(tmp_path).read_text()
    assert report.count("## Workload `code`") == 1
    assert "| policy | 100% (16/16) | 50% (8/16) |" in report              # budgets as columns, largest first
    assert "| full | 10.00 ±0.20 | — |" in report                          # full in the same table, 100 % only
    assert "| lru | 10.50 ±0.20 | 14.00 ±0.20 |" in report
    assert "| oledx | — | 12.00 ±0.20 |" in report
    assert "| lru | 100.0% | 70.0% |" in report                            # hit rate table
    assert "### CPU pairs/iter" in report and "### hits per loaded expert" not in report   # all n/a: no table
    assert "`fiddler` at 0.5 on `code`: needs a popularity file" in report
    assert "commit `0123456789ab`" in report and "Definitions (docs/DESIGN.md, Metrics)" in report
    for name in ("tpot_code.png", "hit_util_code.png", "h2d_cpu_code.png", "breakdown_lru_0.5_code.png"):
        png = tmp_path / "plots" / name
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG", name
        assert f"plots/{name}" in report


def test_render_cli(tmp_path):
    from oled.cli import main
    rows, series = _fixture_rows()
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["bench", "--render", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "| lru | 10.50 ±0.20 | 14.00 ±0.20 |" in report


def test_render_reads_gzipped_results_as_committed(tmp_path):
    """Committed result folders keep results.jsonl gzipped (results.jsonl.gz): --render reads it the same."""
    import gzip

    from oled.cli import main
    rows, series = _fixture_rows()
    (tmp_path / "results.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    assert main(["bench", "--render", str(tmp_path)]) == 0
    assert "| lru | 10.50 ±0.20 | 14.00 ±0.20 |" in (tmp_path / "report.md").read_text()


def test_replay_grid(tmp_path):
    from oled.config import EngineConfig
    from oled.engine import Engine
    from oled.trace import record_trace

    engine = Engine(EngineConfig(random_weights="tiny", expert_budget="0.5", policy="lru"))
    ids = engine.tokenizer.encode("def add(a, b):\n")
    trace, _ = record_trace(engine, [("p0", ids)], DecodeParams(gen_length=16, block_length=16))
    live = engine.manager.stats.summary()
    path = trace.save(tmp_path / "t.trace")
    rows = run_bench(_cfg(tmp_path, replay=str(path), policies=["full", "lru", "lfu", "fiddler"],
                          budgets=["0.5", "0.25"]))
    by = {(r["policy"], r["budget"]): r for r in rows}
    replayed = {k for k, r in by.items() if r["mode"] == "replay"}
    assert replayed == {("full", "1.0"), ("lru", "0.5"), ("lru", "0.25"), ("lfu", "0.5"), ("lfu", "0.25"),
                        ("fiddler", "0.5"), ("fiddler", "0.25"), ("belady", "0.5"), ("belady", "0.25")}
    assert set(by) - replayed == {(f"bound:belady-{pool}", b) for pool in ("even", "shared") for b in ("0.5", "0.25")
                                  } | {("bound:lookahead-even", b) for b in ("0.5", "0.25")}
    assert all(r["metrics"]["tpot_ms"]["median"] is None for r in rows)    # no cost model in the trace: no times
    misses = {k: r["metrics"]["misses_per_iteration"]["median"] for k, r in by.items()}
    for b in ("0.5", "0.25"):       # the bound: no policy misses fewer experts on this routing
        assert misses[("bound:belady-shared", b)] <= misses[("bound:belady-even", b)] <= min(
            misses[(p, b)] for p in ("lru", "lfu", "fiddler", "belady"))
    assert by[("lru", "0.5")]["metrics"]["hit_rate_tokens"]["median"] == live["hit_rate_tokens"]
    assert by[("fiddler", "0.25")]["metrics"]["cpu_pairs_per_iteration"]["median"] > 0
    report = (tmp_path / "bench" / "report.md").read_text()
    assert "Replay" in report and "### hit rate (tokens)" in report and "### TPOT" not in report

    # cooperative misses plan on a cost model: the trace of a GPU-only run has none, so the cell is skipped with the
    # reason; given one (--cost-model FILE), it runs and computes misses on the CPU
    coop = ["lru:misses=cooperative"]
    assert run_bench(_cfg(tmp_path / "none", replay=str(path), policies=coop, budgets=["0.25"], bound=False)) == []
    (reason,) = [json.loads(x)["reason"] for x in open(tmp_path / "none" / "bench" / "skipped.jsonl")]
    assert "cost model" in reason
    cost_file = tmp_path / "costs.json"
    cost_file.write_text(balanced_costs(engine.store.expert_bytes).to_json())
    (row,) = run_bench(_cfg(tmp_path / "given", replay=str(path), policies=coop, budgets=["0.25"],
                            cost_model=str(cost_file), bound=False))
    assert row["policy_label"] == "lru(misses=cooperative)"
    m = {k: v["median"] for k, v in row["metrics"].items()}
    assert m["cpu_pairs_per_iteration"] > 0 and m["h2d_gb_per_iteration"] > 0


def test_unmet_requirements_are_skipped_with_a_reason(tmp_path):
    cfg = _cfg(tmp_path, policies=["lru", "fiddler"], budgets=["0.5", "0.01"],
               popularity=str(tmp_path / "missing.json"), profile=False)
    rows = run_bench(cfg)
    assert [(r["policy"], r["budget"]) for r in rows] == [("lru", "0.5"), ("bound:belady-even", "0.5"),
                                                          ("bound:lookahead-even", "0.5"), ("bound:belady-shared", "0.5")]
    skipped = [json.loads(x) for x in open(f"{cfg.out}/skipped.jsonl")]
    reasons = {(s["policy"], s["budget"]): s["reason"] for s in skipped}
    assert "too small" in reasons[("*", "0.01")]
    assert "not found" in reasons[("fiddler", "0.5")]


def test_policy_specs():
    assert PolicySpec.parse("lru").label == "lru"
    spec = PolicySpec.parse("tide:tau=2")
    assert spec.name == "tide" and spec.options == {"tau": 2} and spec.label == "tide(tau=2)"
    assert PolicySpec.parse("full").static_full
    with pytest.raises(ValueError, match="unknown policy"):
        PolicySpec.parse("nope")
    with pytest.raises(ValueError, match="no option"):
        PolicySpec.parse("lru:tau=2")


def test_workloads_ship_with_provenance():
    from oled.synth import build_tokenizer, preset_config
    from oled.models.config import config_from_dict
    from oled.tokenizer import Tokenizer

    for name in ("code", "math", "chat", "long"):
        w = wl.load(name)
        assert 8 <= len(w.prompts) <= 16, name
        for key in ("provenance", "written_by", "date", "purpose", "description"):
            assert w.provenance.get(key), (name, key)
        assert len({p.id for p in w.prompts}) == len(w.prompts)
        assert all(p.prompt for p in w.prompts)
    assert "<role>HUMAN</role>" in wl.load("chat").prompts[0].prompt          # chat template applied
    long = wl.load("long-context").prompts[0].prompt
    assert "Question:" in long and len(long) > 5000
    tok = Tokenizer(build_tokenizer(config_from_dict(preset_config("tiny"))))
    a, b = wl.load("synthetic:100", tok), wl.load("synthetic:100", tok)
    assert len(a.prompts) == 8 and all(len(p.ids(tok)) == 100 for p in a.prompts)
    assert [p.token_ids for p in a.prompts] == [p.token_ids for p in b.prompts]      # deterministic
    assert len(wl.load("synthetic:700:3", tok).prompts) == 3
    assert len(wl.load("code", limit=3).prompts) == 3
    with pytest.raises(ValueError, match="unknown workload"):
        wl.load("nope")
    from oled.data import workloads as data_workloads                               # `oled calibrate --workload`
    assert data_workloads.load_prompts("math")[0].prompt


def test_set_runtime_sweeps_without_reloading(tmp_path):
    from oled.config import EngineConfig
    from oled.engine import Engine

    engine = Engine(EngineConfig(random_weights="tiny", expert_budget="1.0", policy="full"))
    ids = engine.tokenizer.encode("Hello")
    params = DecodeParams(gen_length=16, block_length=16)
    ref = engine.generate_ids(ids, params).token_ids
    store, model = engine.store, engine.model
    for policy, budget in (("lru", "0.25"), ("lfu", "0.5"), ("full", "1.0")):
        old = engine.manager
        engine.set_runtime(policy, budget)
        assert engine.manager is not old and engine.store is store and engine.model is model
        assert all(b.experts is engine.manager for b in model.moe_blocks())
        assert engine.policy.name == policy
        assert engine.generate_ids(ids, params).token_ids == ref


def test_cpu_policy_lines_carry_the_cost_model_and_its_error(tmp_path):
    rows = run_bench(_cfg(tmp_path, policies=["lru", "tide", "lru:misses=cooperative"], budgets=["0.25"], prompts=1,
                          profile=False, cpu_threads=1))
    coop = next(r for r in rows if r["policy_label"] == "lru(misses=cooperative)")
    assert coop["cost_model"]["source"].startswith("measured") and coop["policy_options"] == {"misses": "cooperative"}
    (row,) = [r for r in rows if r["policy"] == "tide"]
    cost = row["cost_model"]
    assert cost["source"].startswith("measured") and set(cost["cpu_seconds"]) == {"1", "2", "4", "8", "16", "32"}
    m = {k: v["median"] for k, v in row["metrics"].items()}
    assert m["cpu_pairs_per_iteration"] > 0 and m["cpu_ms_per_iteration"] > 0 and m["cpu_cost_model_ratio"] > 0
    lru = next(r for r in rows if r["policy_label"] == "lru")
    assert lru["cost_model"] is None and lru["metrics"]["cpu_cost_model_ratio"]["median"] is None


def test_the_ttft_benchmark_runs_on_the_cpu_and_counts_what_had_to_cross(tmp_path):
    """benchmarks/ttft.py end to end on the tiny preset: one line per (budget, prompt length); with every expert
    resident nothing has to cross, under a budget the misses do; the first block comes after the prefill; the
    floors are NaN without a GPU's measured bandwidth."""
    import json
    from types import SimpleNamespace

    ttft = benchmark_script("ttft")
    records = [SimpleNamespace(experts=5, experts_hit=2), SimpleNamespace(experts=3, experts_hit=3)]
    assert ttft.missed_bytes(records, 100) == 300
    out = tmp_path / "ttft.jsonl"
    assert ttft.main(["--random-weights", "tiny", "--device", "cpu", "--budgets", "1.0,0.5", "--prompt-tokens",
                      "40", "--repeats", "1", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["budget"], r["prompt_tokens"]) for r in lines] == [("1.0", 40), ("0.5", 40)]
    full, half = lines
    assert full["prefill_missed_bytes"] == 0 and half["ttft_missed_bytes"] > 0
    assert all(r["ttft_s"] >= r["prefill_s"] > 0 for r in lines)
    assert all(r["ttft_floor_s"] != r["ttft_floor_s"] for r in lines)           # NaN on the CPU
    # the bound: the larger of the floor and the 100 % run's time (here, without a floor, that time)
    assert full["ttft_over_bound"] == full["prefill_over_bound"] == 1.0
    assert half["ttft_bound_s"] == full["ttft_s"] and half["prefill_bound_s"] == full["prefill_s"]
    assert half["ttft_over_bound"] == half["ttft_s"] / full["ttft_s"]
    # in series, without a floor: the 100 % run's prefill-free first block, or the bound above where larger
    first_block = full["ttft_s"] - full["prefill_s"]
    assert half["ttft_serial_bound_s"] == max(half["ttft_bound_s"], first_block)
    assert full["ttft_over_serial_bound"] == 1.0


def test_merge_grids_takes_each_run_from_the_last_folder_that_has_it(tmp_path):
    """benchmarks/merge_grids.py: a later folder's run replaces an earlier one's of the same run id and mode; the
    others are kept; sources.json says where each came from; the report renders."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    merge = benchmark_script("merge_grids")
    grid = root / "benchmarks/results/h200/mini-grid-76ca9e3/results.jsonl.gz"
    rows = [json.loads(line) for line in gzip.open(grid, "rt")]
    first, second = tmp_path / "first", tmp_path / "second"
    for d in (first, second):
        d.mkdir()
    (first / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    newer = dict(rows[1], timestamp="later")
    (second / "results.jsonl").write_text(json.dumps(newer) + "\n")
    out = tmp_path / "merged"
    assert merge.main([str(first), str(second), "--out", str(out)]) == 0
    merged = [json.loads(line) for line in open(out / "results.jsonl")]
    assert [r["run_id"] for r in merged] == [r["run_id"] for r in rows[:3]]
    assert merged[1]["timestamp"] == "later" and merged[0] == rows[0] and merged[2] == rows[2]
    sources = json.loads((out / "sources.json").read_text())
    assert [s["from"] for s in sources] == [str(first), str(second), str(first)]
    assert "TPOT" in (out / "report.md").read_text()


def test_offload_overhead_times_the_host_steps_and_puts_the_methods_back():
    """benchmarks/offload_overhead.py on the tiny preset, on the CPU: per-forward host times of the wrapped steps
    (the policy's step inside host step one), and every wrapped method restored after the timed generate."""

    from oled.config import EngineConfig
    from oled.decoding.params import DecodeParams
    from oled.engine import Engine
    from oled.runtime.device_state import DeviceSlots

    bench = benchmark_script("offload_overhead")
    engine = Engine(EngineConfig(random_weights="tiny", device="cpu", dtype="float32", policy="lru",
                                 expert_budget="0.25"))
    sync_slot_map = DeviceSlots.__dict__["sync"]
    out = bench.measure(engine, engine.tokenizer.encode("def f(x):"), DecodeParams(gen_length=16, block_length=16),
                        "lru@0.25", float("nan"))
    host = out["host_ms_per_forward"]
    assert host["decide_offloaded (host step one)"] >= host["residency.begin_layer (policy)"] > 0
    assert out["calls_per_forward"]["decide_offloaded (host step one)"] == len(engine.manager.layers)
    assert out["calls_per_forward"]["policy.on_iteration"] == 1.0          # one event a denoising forward
    assert 0 < out["decode_wall_ms_per_forward"] < out["wall_ms_per_forward"] and out["prefill_ms"] > 0
    assert "on_iteration" not in vars(engine.manager.policy)
    assert "sync" not in vars(engine.manager.slots) and DeviceSlots.__dict__["sync"] is sync_slot_map
    assert out["graph_replay_alone"] == []              # no CUDA graphs on the CPU


def test_ms_per_forward_is_the_decode_time_over_the_forwards(live):
    """ms/forward = decode wall time / NFE, per repeat: TPOT x generated tokens / NFE, so runs that decode another
    number of forwards compare per forward."""
    _, rows = live
    for r in (r for r in rows if r["mode"] == "live"):
        m = r["metrics"]
        for tpot, gen, nfe, per_forward in zip(m["tpot_ms"]["values"], m["generated_tokens"]["values"],
                                              m["nfe"]["values"], m["ms_per_forward"]["values"]):
            assert nfe > 0 and abs(per_forward - tpot * gen / nfe) < 1e-9 * max(1.0, per_forward)




@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
@pytest.mark.parametrize("script", ["graph_launch_probe.py", "forward_gaps.py", "host_flag_probe.py",
                                    "h2d_calibration.py"])
def test_the_cuda_timeline_probes_refuse_to_run_without_cuda(tmp_path, capsys, script):
    """benchmarks/graph_launch_probe.py times CUDA graph launches, forward_gaps.py reads CUDA events and
    host_flag_probe.py times a kernel waiting for the host, h2d_calibration.py times copies to the GPU: without a
    GPU each exits 2 with one line and writes nothing."""
    probe = benchmark_script(script)
    out = tmp_path / "probe.json"
    assert probe.main(["--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"{script} needs a CUDA device" and captured.out == "" and not out.exists()


def test_the_forward_gaps_host_tails_split_each_steady_forward_at_its_last_read_back():
    """forward_gaps.host_tails: per steady forward, the host's time from its last routing read-back to its
    end_forward, and from there to the next forward; a forward that is not steady (prefill) is left out."""
    gaps = benchmark_script("forward_gaps.py")
    marks = [("forward", 0.0), ("end_forward", 0.001),                        # prefill: not steady
             ("forward", 0.010), ("_read_routing", 0.011), ("_read_routing", 0.013), ("end_forward", 0.0135),
             ("forward", 0.0145), ("_read_routing", 0.016), ("end_forward", 0.0180),
             ("forward", 0.0200)]
    tails = gaps.host_tails(marks, [False, True, True, True])
    assert tails["host_after_last_readback_ms"] == pytest.approx(statistics.median([0.5, 2.0]))
    assert tails["host_end_forward_to_next_ms"] == pytest.approx(statistics.median([1.0, 2.0]))


def test_the_forward_gaps_idle_time_is_pinned_to_the_activities_around_it():
    """forward_gaps.idle_between: idle time where no activity runs on any stream, summed per forward by the names
    before and after each gap; an activity overlapping another (a copy beside a kernel) leaves no gap, and gaps of
    1 us or less are the profiler's resolution."""
    from types import SimpleNamespace

    gaps = benchmark_script("forward_gaps.py")

    def act(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    acts = [act("a", 0, 10), act("copy", 5, 30), act("b", 40, 50),          # 10 us idle: copy -> b
            act("a", 100, 110), act("b", 110.5, 120),                       # 50 us b -> a; 0.5 us: not counted
            act("c", 125, 126), act("a", 200, 210)]                         # 5 us b -> c, 74 us c -> a
    idle = gaps.idle_between(acts, forwards=2, top=10)
    assert [(g["before"], g["after"], g["us"], g["gaps"]) for g in idle] == [
        ("c", "a", 37.0, 0.5), ("b", "a", 25.0, 0.5), ("copy", "b", 5.0, 0.5), ("b", "c", 2.5, 0.5)]


def test_compare_grids_flags_slower_cells_by_their_bytes_and_judges_the_targets(tmp_path, capsys):
    """benchmarks/compare_grids.py: a cell whose time a forward grew past the tolerance is flagged, "same bytes" when
    its reads and copies are REF's and "bytes differ" otherwise; the others are not; a slower read of an expert from
    host memory in NEW's cost model predicts each cell's change from its reads; the targets are oled's TPOT over
    full's, the fastest baseline (not full, not oled's variants) over oled, and every policy's misses over belady's
    bound rows and TPOT over each time bound's."""
    from pathlib import Path

    compare = benchmark_script("compare_grids")
    grid = Path(__file__).resolve().parents[1] / "benchmarks/results/h200/s35/call3/tree/res/grid/results.jsonl.gz"
    rows = [json.loads(line) for line in gzip.open(grid, "rt")]
    ref, new = tmp_path / "ref", tmp_path / "new"
    for d in (ref, new):
        d.mkdir()
    (ref / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    changed = []
    for r in rows:
        r = json.loads(json.dumps(r))
        if r["mode"] == "live" and (r["policy_label"], r["budget"]) in (("lru", "0.4"), ("tide", "0.6")):
            r["metrics"]["ms_per_forward"]["median"] *= 1.1
            if r["policy_label"] == "tide":
                r["metrics"]["mapped_gb_per_iteration"]["median"] += 0.01
        if r.get("cost_model"):
            r["cost_model"]["mapped_seconds"] += 1e-4          # a machine whose kernels read an expert 100 us slower
        if r["mode"] == "live":
            r["metrics"]["misses_per_iteration"] = {"median": 30.0 if r["policy"] == "oled" else 45.0}
        changed.append(r)
    template = next(r for r in rows if r["mode"] == "bound")
    for name, misses, tpot in (("bound:belady-even", 20.0, None), ("bound:belady-shared", 15.0, None),
                               ("bound:demand-link-even", 20.0, 2.0), ("bound:prefetch-even", 22.0, 1.6)):
        changed.append(dict(template, policy=name, policy_label=name, budget="0.4",
                            metrics={"misses_per_iteration": {"median": misses}, "tpot_ms": {"median": tpot}}))
    (new / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in changed))
    out = tmp_path / "cmp.json"
    assert compare.main([str(ref), str(new), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    slower = {(c["policy"], c["budget"]): c["same_bytes"] for c in result["cells"] if c["slower"]}
    assert slower == {("lru", "0.4"): True, ("tide", "0.6"): False}
    assert len(result["cells"]) == sum(r["mode"] == "live" for r in rows)
    printed = capsys.readouterr().out
    assert "slower, same bytes" in printed and "the reads' difference alone predicts" in printed
    lru = next(c for c in result["cells"] if (c["policy"], c["budget"]) == ("lru", "0.25"))
    expert_bytes = next(r["cost_model"]["expert_bytes"] for r in rows if r.get("cost_model"))
    assert lru["read_delta_ms"] == pytest.approx(lru["mapped_gb"] * 1e9 / expert_bytes * 0.1) and lru["mapped_gb"] > 0
    live = {(r["policy_label"], r["budget"]): r["metrics"] for r in rows if r["mode"] == "live"}
    goal = result["targets"]
    tpot = {k: m["tpot_ms"]["median"] for k, m in live.items()}
    assert goal["tpot_over_full"] == tpot["oled", "0.4"] / tpot["full", "1.0"]
    baselines = {k: t for k, t in tpot.items() if k[1] == "0.4" and k[0].split("(")[0] not in
                 ("full", "oled", "oled-retain", "oled-coop")}
    assert goal["best_baseline_tpot_ms"] == min(baselines.values()) and goal["best_baseline"] != "oled-retain"
    oled = goal["against_bounds"]["oled"]
    assert oled["misses_over"] == {"bound:belady-even": 1.5, "bound:belady-shared": 2.0}
    assert oled["tpot_over"] == pytest.approx({"bound:demand-link-even": tpot["oled", "0.4"] / 2.0,
                                               "bound:prefetch-even": tpot["oled", "0.4"] / 1.6})
    assert goal["against_bounds"]["lru"]["misses_over"]["bound:belady-even"] == 45.0 / 20.0
    assert set(goal["against_bounds"]) == {k[0] for k in live if k[1] == "0.4"}
    assert "against the bounds at 0.4" in printed and "utilisation" not in printed
    empty = tmp_path / "empty"
    empty.mkdir()
    assert compare.main([str(ref), str(empty)]) == 1


def test_replay_takes_the_cost_model_of_a_gzipped_grid(tmp_path):
    """--cost-model FILE accepts a grid's results.jsonl.gz as it accepts the JSON, and the cooperative policies and
    the time bounds plan on it; a malformed file is one line naming it."""
    from oled.policies.costs import CostModel
    root = Path(__file__).parents[1]
    grid = root / "benchmarks/results/h200/s34/call4/grid/results.jsonl.gz"
    rows = run_bench(BenchConfig(replay=str(root / "tests/data/tiny-code.trace"), cost_model=str(grid),
                                 policies=["oled-coop"], budgets=["0.4"], out=str(tmp_path / "r"), progress=False))
    assert [r["status"] for r in rows if r["policy"] == "oled-coop"] == ["ok"]
    coop_bound = [r for r in rows if r["policy"] == "bound:demand-coop-even"]
    assert coop_bound and coop_bound[0]["cost_table"]["link_ms"] == \
        pytest.approx(CostModel.from_file(grid).load_seconds(1) * 1e3)
    bad = tmp_path / "bad.json"
    bad.write_text("garbage")
    with pytest.raises(ValueError, match=f"{bad}: malformed cost model"):
        CostModel.from_file(bad)


def test_bounds_without_a_full_row_take_a_warm_reference_pass(tmp_path, monkeypatch):
    from oled.bench.live import LiveRuns

    calls = []
    generate = LiveRuns._generate

    def counting(self, engine, request, ids, stand_in=None, timer=None):
        calls.append(engine.policy.name)
        return generate(self, engine, request, ids, stand_in=stand_in, timer=timer)

    monkeypatch.setattr(LiveRuns, "_generate", counting)
    rows = run_bench(_cfg(tmp_path, policies=["lru:misses=cooperative"], budgets=["0.5"], prompts=2, warmup=0,
                          profile=False, cpu_threads=1))
    assert calls.count("full") == 3                 # the warm-up prompt, then the timed pass over both prompts
    bounds = [r for r in rows if r["policy"].startswith("bound:demand")]
    assert bounds and all("after a warm-up prompt" in r["cost_table"]["source"] for r in bounds)
    calls.clear()
    rows = run_bench(_cfg(tmp_path, policies=["full", "lru:misses=cooperative"], budgets=["0.5"], prompts=2,
                          warmup=0, profile=False, cpu_threads=1))
    assert calls.count("full") == 2 + 2             # the reference pass and full's own timed row, no warm-up
    bounds = [r for r in rows if r["policy"].startswith("bound:demand")]
    assert bounds and all("full's grid row" in r["cost_table"]["source"] for r in bounds)
