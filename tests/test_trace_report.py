"""oled trace --report: the statistics that judge a trace against the real model (oled/trace/realism.py) against a
plain-Python reference, their Markdown table (benchmarks/traces/README.md is its output), and the replay
sub-reports' command line."""
from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import numpy as np
import pytest

from oled.cli import main
from oled.trace import Trace, locality
from oled.trace.published import PUBLISHED
from oled.trace.realism import COLUMNS, CV_LAYER, markdown_table, realism

ROOT = Path(__file__).parents[1]
TINY_TRACE = ROOT / "tests/data/tiny-code.trace"
README = ROOT / "benchmarks/traces/README.md"


@pytest.fixture(scope="module")
def tiny():
    return Trace.load(TINY_TRACE)


def reference(trace: Trace, r: int) -> dict:
    """The statistics of request r computed one forward, layer and expert at a time."""
    B = trace.header["decode"]["block_length"]
    E = trace.header["model"]["num_experts"]
    forwards = [f for f in range(len(trace.fwd_kind)) if trace.fwd_kind[f] == 1 and trace.fwd_request[f] == r]
    counts = {"all": [], "block": []}       # per forward: per layer: [E] list
    for f in forwards:
        per = {"all": [], "block": []}
        for layer in trace.layers:
            run = next(i for i in range(len(trace.run_layer))
                       if trace.run_forward[i] == f and trace.run_layer[i] == layer)
            ids = trace.run_ids(run)
            for rows in per:
                c = [0] * E
                for row, experts in enumerate(ids.tolist()):
                    position = int(trace.fwd_start[f]) + row
                    in_block = trace.fwd_block_start[f] <= position < trace.fwd_block_start[f] + B
                    if rows == "all" or in_block:
                        for e in experts:
                            c[e] += 1
                per[rows].append(c)
        for rows in per:
            counts[rows].append(per[rows])
    unique = {rows: [[sum(1 for x in c if x) for c in fwd] for fwd in counts[rows]] for rows in counts}
    out = {"iterations": len(forwards), "generated_tokens": len(trace.output_ids(r)),
           "tokens_per_forward": len(trace.output_ids(r)) / len(forwards),
           "unique_experts": float(np.mean(unique["all"])), "unique_experts_block": float(np.mean(unique["block"]))}
    cvs = []
    for j in range(len(trace.layers)):
        series = [u[j] for u in unique["all"]]
        m = sum(series) / len(series)
        cvs.append(math.sqrt(sum((x - m) ** 2 for x in series) / len(series)) / m)
    out["unique_cv"] = sum(cvs) / len(cvs)
    out["unique_cv_layer10"] = cvs[trace.layers.index(CV_LAYER)] if CV_LAYER in trace.layers else None
    for lag in (1, 5):
        for rows in counts:
            values = []
            for a in range(len(forwards) - lag):
                if trace.fwd_block_start[forwards[a]] != trace.fwd_block_start[forwards[a + lag]]:
                    continue
                for ca, cb in zip(counts[rows][a], counts[rows][a + lag]):
                    dot = sum(x * y for x, y in zip(ca, cb))
                    values.append(dot / math.sqrt(sum(x * x for x in ca) * sum(y * y for y in cb)))
            out[f"cosine_{lag}_{rows}"] = sum(values) / len(values)
    return out


def test_the_statistics_of_each_request_equal_a_plain_reference(tiny):
    rep = realism(tiny)
    assert len(rep["requests"]) == tiny.num_requests == 3
    r = 1
    expected = reference(tiny, r)
    got = rep["requests"][r]
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-12) if value is not None else got[key] is None, key
    assert got["request"] == tiny.header["requests"][r]
    # the cosine is below 1 where the routing changes, and five iterations apart below one apart on this trace
    assert 0 < got["cosine_5_block"] < got["cosine_1_block"] < 1


def test_the_whole_traces_statistics_pool_its_requests(tiny):
    rep = realism(tiny)
    reqs, whole = rep["requests"], rep["overall"]
    assert whole["iterations"] == int((tiny.fwd_kind == 1).sum()) == sum(s["iterations"] for s in reqs)
    assert whole["generated_tokens"] == len(tiny.req_output_ids)
    assert whole["tokens_per_forward"] == pytest.approx(whole["generated_tokens"] / whole["iterations"])
    # pooled over every layer and iteration: the locality report's mean (its definition, over forward rows)
    assert whole["unique_experts"] == pytest.approx(locality(tiny)["unique_experts_per_layer_iteration"]["mean"])
    weights = [s["iterations"] for s in reqs]
    assert whole["unique_cv"] == pytest.approx(np.average([s["unique_cv"] for s in reqs], weights=weights))
    assert min(s["cosine_1_all"] for s in reqs) <= whole["cosine_1_all"] <= max(s["cosine_1_all"] for s in reqs)
    assert whole["unique_cv_layer10"] is None       # the tiny model has no layer 10


def test_a_first_requests_trace_has_that_requests_statistics(tiny):
    one = realism(tiny.first_requests(1))
    assert one["requests"] == realism(tiny)["requests"][:1]
    assert one["overall"]["unique_experts"] == pytest.approx(one["requests"][0]["unique_experts"])


def test_every_published_figure_is_a_reported_statistic_with_a_source():
    keys = {key for key, _, _ in COLUMNS}
    assert all(p.key in keys and p.source and p.setting for p in PUBLISHED)
    assert {p.key for p in PUBLISHED} >= {"unique_experts", "unique_cv_layer10", "tokens_per_forward",
                                           "cosine_1_all", "cosine_5_all"}


def test_the_markdown_table_and_the_command(tiny, capsys):
    rep = realism(tiny)
    table = markdown_table([("tiny", rep)])
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    models = {p.model for p in PUBLISHED}
    assert len(rows) == 1 + tiny.num_requests + 1 + len(models)     # heading, requests, the whole, published
    assert all(line.count("|") == len(COLUMNS) + 3 for line in rows)
    assert "69.5" in table and "2.55" in table and "arXiv 2605.30876" in table
    assert main(["trace", "--report", str(TINY_TRACE), str(TINY_TRACE), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.count("| **all** |") == 2 and out.count(f"| `{TINY_TRACE}` (block 32,") == 2


def test_the_readme_table_is_the_commands_output(capsys, monkeypatch):
    """benchmarks/traces/README.md holds the output of the command it names, between its markers."""
    monkeypatch.chdir(ROOT)
    text = README.read_text()
    begin, end = "<!-- statistics: ", "<!-- end of statistics -->"
    command = text[text.index(begin) + len(begin): text.index(" -->", text.index(begin))]
    table = text[text.index("-->", text.index(begin)) + 3: text.index(end)].strip()
    argv = shlex.split(command)
    assert argv[:2] == ["oled", "trace"] and "--markdown" in argv
    assert main(argv[1:]) == 0
    assert capsys.readouterr().out.strip() == table


def test_the_report_prints_the_statistics_and_the_locality_and_writes_both(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["trace", "--report", str(TINY_TRACE), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Statistics against the real model" in text and "Jaccard" in text and "(published)" in text
    rep = json.loads(out.read_text())
    assert rep["statistics"]["overall"]["iterations"] == rep["iterations"]


def test_a_sub_report_prints_json_lines_and_writes_them(tmp_path, capsys):
    out = tmp_path / "forced.json"
    assert main(["trace", "--report", str(TINY_TRACE), "--forced", "--budgets", "0.5,0.3", "--first", "2",
                 "--json", str(out)]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["budget"] for r in printed] == ["0.5", "0.3"] and json.loads(out.read_text()) == printed
    from oled.trace.forced_misses import forced_misses
    tiny = Trace.load(TINY_TRACE).first_requests(2)
    assert printed[1] == forced_misses(tiny, "0.3", tiny.header["model"]["expert_bytes"])


@pytest.mark.parametrize("argv,message", [
    (["--coverage", "--out", "x.trace"], "give --report TRACE"),
    (["--report", str(TINY_TRACE), "--coverage", "--windows", "1,2"], "--coverage does not use --windows"),
    (["--report", str(TINY_TRACE), "--forced", "--policies", "lru"], "--forced does not use --policies"),
    (["--report", str(TINY_TRACE), str(TINY_TRACE), "--bursts"], "take one trace"),
    (["--report", str(TINY_TRACE), "--bursts", "--burst-steps", "0"], "--burst-steps: at least 1"),
    (["--report", str(TINY_TRACE), "--ahead", "--windows", "0,2"], "--windows"),
    (["--report", str(TINY_TRACE), "--policies", "lru"], "options of the replay sub-reports"),
    (["--report", str(TINY_TRACE), "--markdown", "--predictor"], "--markdown"),
    (["--report", str(TINY_TRACE), "--runner-ups", "1,2"], "--runner-ups"),
])
def test_bad_report_options_are_one_line_and_exit_2(argv, message, capsys):
    assert main(["trace", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_grid_on_a_trace_takes_all_its_requests_unless_a_sample_is_asked_for_and_stated():
    from oled.trace.selection import MIN_SAMPLE, sampled_requests

    assert sampled_requests(3, None) == (3, None) and sampled_requests(3, 5) == (3, None)
    n, note = sampled_requests(5, 1)
    assert n == 1 and "the first 1 of 5" in note and f"fewer than {MIN_SAMPLE}" in note
    n, note = sampled_requests(5, MIN_SAMPLE)
    assert n == MIN_SAMPLE and "the first 3 of 5" in note and "fewer" not in note
    with pytest.raises(ValueError, match="at least one"):
        sampled_requests(3, 0)


@pytest.mark.parametrize("prompts", [None, 1])
def test_bench_replay_replays_every_request_or_states_its_sample(tmp_path, prompts):
    from oled.bench import BenchConfig, run_bench

    tiny = Trace.load(TINY_TRACE)
    (row,) = run_bench(BenchConfig(replay=str(TINY_TRACE), policies=["lru"], budgets=["0.5"], bound=False,
                                   prompts=prompts, out=str(tmp_path / "b"), progress=False))
    n = tiny.num_requests if prompts is None else prompts
    assert len(row["prompts"]) == n
    assert row["metrics"]["generated_tokens"]["median"] == len(tiny.first_requests(n).req_output_ids)
    sample = row["workload"]["sample"]
    if prompts is None:
        assert sample is None
    else:
        assert "the first 1 of 3" in sample and sample in row["model"]["note"]
        assert sample in (tmp_path / "b/report.md").read_text()


def test_bench_routing_replays_every_request_or_states_its_sample(tmp_path, capsys):
    argv = ["--random-weights", "tiny", "--seed", "3", "--dtype", "float32", "--device", "cpu"]
    path = tmp_path / "t.trace"
    assert main(["trace", *argv, "--prompts", "3", "--gen-length", "8", "--block-length", "8", "--policy", "full",
                 "--out", str(path)]) == 0
    grid = ["bench", "--routing", str(path), *argv, "--policies", "lru", "--budgets", "0.5", "--repeats", "1",
            "--warmup", "0", "--no-profile", "--no-bound", "--no-progress"]
    for prompts, n in ((None, 3), (1, 1)):
        out = tmp_path / f"b{prompts}"
        assert main(grid + ["--out", str(out)] + ([] if prompts is None else ["--prompts", str(prompts)])) == 0
        (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        routing = row["model"]["routing"]
        assert (routing["requests"], routing["of_requests"], len(row["prompts"])) == (n, 3, n)
        if prompts is None:
            assert routing["sample"] is None
        else:
            assert "the first 1 of 3" in routing["sample"] and routing["sample"] in (out / "report.md").read_text()
            assert "the first 1 of 3" in capsys.readouterr().out
