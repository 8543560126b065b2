"""benchmarks/record.py: the generated parts of BENCHMARKS.md and the README, and the plot, from the result sets the
manifest names; --check fails while any of them is stale."""
import json
from pathlib import Path

import pytest

from tests.scripts import benchmark_script

ROOT = Path(__file__).resolve().parents[1]
record = benchmark_script("record")

MANIFEST = """
policies = ["full", "oled", "lru"]
readme_budget = "0.4"
readme_policies = ["oled", "lru"]
plot_grid = "g"
plot_path = "docs/img/tpot.png"

[[grid]]
name = "g"
column = "grid g"
title = "Grid g"
results = "res/g"
commit = "abc1234"
hardware = "a test machine"
shows = "two budgets"
command = "oled bench ..."
"""


def line(policy: str, budget: str, ms: float | None, mode: str = "live") -> dict:
    return {"mode": mode, "status": "ok", "policy_label": policy, "budget": budget,
            "metrics": {"tpot_ms": {"median": ms}},
            "env": {"gpu": {"name": "GPU-X"}, "cpu": {"logical_cpus": 4, "model": "CPU-Y"},
                    "versions": {"torch": "2.0"}}}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks/record.toml").write_text(MANIFEST)
    (tmp_path / "res/g").mkdir(parents=True)
    lines = [line("full", "1.0", 2.0), line("oled", "1.0", 2.1), line("oled", "0.4", 3.0), line("lru", "0.4", 5.0),
             line("belady", "0.4", None, mode="bound")]
    (tmp_path / "res/g/results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for doc, part in (("BENCHMARKS.md", record.BENCHMARKS_PART), ("README.md", record.README_PART)):
        begin, end = record.markers(part)
        (tmp_path / doc).write_text(f"# {doc}\n\nbefore\n\n{begin}\nold\n{end}\n\nafter\n")
    return tmp_path


def test_record_writes_tables_and_plot_then_check_passes(repo):
    assert record.main(["--check", "--root", str(repo)]) == 1
    assert record.main(["--root", str(repo)]) == 0
    bench = (repo / "BENCHMARKS.md").read_text()
    assert bench.startswith("# BENCHMARKS.md\n\nbefore\n") and bench.endswith("\n\nafter\n")
    assert "| policy | 100 % | 40 % |" in bench
    assert "| oled | 2.100 (1.05 ×) | 3.000 (1.50 ×) |" in bench
    assert "| lru | — | 5.000 (2.50 ×) |" in bench
    assert "belady" not in bench.split("`report.md`")[1]                    # a bound has no time: no row
    assert "code of `abc1234`; GPU-X, 4 CPUs (CPU-Y), torch 2.0; a test machine." in bench
    readme = (repo / "README.md").read_text()
    assert "| `full` at 100 % | 2.000 |" in readme and "| lru | 5.000 (2.50 ×) |" in readme
    assert record.stored_digest(repo / "docs/img/tpot.png") is not None
    assert record.main(["--check", "--root", str(repo)]) == 0


def test_check_fails_on_an_edited_table_or_new_results(repo):
    record.main(["--root", str(repo)])
    readme = repo / "README.md"
    readme.write_text(readme.read_text().replace("5.000", "4.000"))
    assert record.main(["--check", "--root", str(repo)]) == 1
    record.main(["--root", str(repo)])
    assert record.main(["--check", "--root", str(repo)]) == 0
    results = repo / "res/g/results.jsonl"
    results.write_text(results.read_text().replace('"median": 5.0', '"median": 6.0'))
    assert record.main(["--check", "--root", str(repo)]) == 1               # tables and plot both stale


def test_missing_marker_or_reference_is_one_line_and_exit_2(repo, capsys):
    (repo / "README.md").write_text("# no markers\n")
    assert record.main(["--root", str(repo)]) == 2
    assert "README.md: needs one `<!-- record:begin readme-results -->`" in capsys.readouterr().err
    assert "old" in (repo / "BENCHMARKS.md").read_text()                      # nothing written on an error
    results = repo / "res/g/results.jsonl"
    results.write_text("".join(l for l in results.read_text().splitlines(True) if '"full"' not in l))
    assert record.main(["--check", "--root", str(repo)]) == 2
    assert "no live `full` run at 100 %" in capsys.readouterr().err


def test_committed_record_is_current():
    """The repository's BENCHMARKS.md, README and plot are what the manifest's result sets give."""
    assert record.main(["--check"]) == 0


def test_manifest_commits_match_the_result_lines():
    """Each grid's commit is the one its result lines name (a stale manifest entry would misstate the code)."""
    _, grids = record.load_manifest(ROOT)
    for grid in grids:
        commits = {r["env"]["git"]["commit"] for r in record.result_lines(ROOT / grid.results)}
        assert all(c.startswith(grid.lines_commit or grid.commit) for c in commits), (grid.name, commits)
