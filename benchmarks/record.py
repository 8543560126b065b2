"""The record's generated parts, from the committed result sets that benchmarks/record.toml names.

Writes, between `<!-- record:begin NAME -->` and `<!-- record:end NAME -->` markers, the current results of
BENCHMARKS.md (one table per grid: ms per token and its ratio to `full`, per policy and budget, with the machine and
the commit) and the README's one small table (every grid at one budget), and draws the plot (ms per token against the
budget, one line per policy). `--check` writes nothing and exits 1 when a generated part differs from the committed
one: the plot is compared by the digest of the figures it draws, stored in the PNG, not by its pixels.

    python3 benchmarks/record.py [--check] [--root DIR]
"""

import argparse
import gzip
import hashlib
import json
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.ticker import ScalarFormatter  # noqa: E402
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "benchmarks/record.toml"
BENCHMARKS_MD = "BENCHMARKS.md"
README_MD = "README.md"
BENCHMARKS_PART = "current-results"
README_PART = "readme-results"
REFERENCE = "full"
GRID_FIELDS = ("name", "column", "title", "results", "commit", "hardware", "shows", "command")
PLOT_DIGEST_KEY = "oled-record-digest"
PLOT_SIZE_INCHES = (7.0, 4.2)
PLOT_DPI = 110
LINE_WIDTH = 118


class RecordError(Exception):
    """A manifest, result set or marker the record cannot use: one line for the user."""


@dataclass(frozen=True)
class Grid:
    name: str
    column: str                                    # its column in the README's table
    title: str
    results: str
    commit: str
    hardware: str
    shows: str
    command: str
    machine: str                                   # GPU, CPU and torch as the result lines name them
    ms: dict[tuple[str, float], float]             # (policy label, budget fraction) -> median ms per token
    lines_commit: str = ""                         # the commit the result lines name where the machine's git
                                                   # metadata was stale (the code is `commit`); "" when they agree

    @property
    def budgets(self) -> list[float]:
        return sorted({budget for _, budget in self.ms}, reverse=True)

    def policies(self, order: list[str]) -> list[str]:
        seen = list(dict.fromkeys(label for label, _ in self.ms))
        return [p for p in order if p in seen] + [p for p in seen if p not in order]

    def ratio(self, label: str, budget: float) -> float | None:
        ms, ref = self.ms.get((label, budget)), self.ms.get((REFERENCE, 1.0))
        return None if ms is None or ref is None else ms / ref


def result_lines(folder: Path) -> list[dict]:
    for name, opener in (("results.jsonl", open), ("results.jsonl.gz", gzip.open)):
        if (folder / name).is_file():
            with opener(folder / name, "rt") as f:
                return [json.loads(line) for line in f if line.strip()]
    raise RecordError(f"{folder}: no results.jsonl or results.jsonl.gz")


def machine_of(line: dict) -> str:
    env = line.get("env", {})
    gpu = (env.get("gpu") or {}).get("name") or env.get("label") or "CPU"
    cpu = env.get("cpu", {})
    torch = env.get("versions", {}).get("torch", "?")
    return f"{gpu}, {cpu.get('logical_cpus', '?')} CPUs ({cpu.get('model', '?')}), torch {torch}"


def load_grid(entry: dict, root: Path) -> Grid:
    missing = set(GRID_FIELDS) - entry.keys()
    if missing:
        raise RecordError(f"{MANIFEST}: grid {entry.get('name', '?')!r} lacks {', '.join(sorted(missing))}")
    lines = [r for r in result_lines(root / entry["results"]) if r.get("mode") == "live" and r.get("status") == "ok"]
    ms = {(r["policy_label"], float(r["budget"])): r["metrics"]["tpot_ms"]["median"] for r in lines}
    if (REFERENCE, 1.0) not in ms:
        raise RecordError(f"{entry['results']}: no live `{REFERENCE}` run at 100 %")
    return Grid(**{k: entry[k] for k in GRID_FIELDS}, machine=machine_of(lines[0]), ms=ms,
                lines_commit=entry.get("lines_commit", ""))


def load_manifest(root: Path) -> tuple[dict, list[Grid]]:
    path = root / MANIFEST
    if not path.is_file():
        raise RecordError(f"{path}: no manifest")
    with open(path, "rb") as f:
        manifest = tomllib.load(f)
    grids = [load_grid(entry, root) for entry in manifest.get("grid", [])]
    if not grids:
        raise RecordError(f"{path}: names no [[grid]]")
    return manifest, grids


def percent(budget: float) -> str:
    return f"{budget * 100:g} %"


def cell(grid: Grid, label: str, budget: float) -> str:
    ms = grid.ms.get((label, budget))
    return "—" if ms is None else f"{ms:.3f} ({grid.ratio(label, budget):.2f} ×)"


def grid_table(grid: Grid, order: list[str]) -> list[str]:
    budgets = grid.budgets
    rows = ["| policy | " + " | ".join(percent(b) for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for label in grid.policies(order):
        rows.append(f"| {label} | " + " | ".join(cell(grid, label, b) for b in budgets) + " |")
    return rows


def paragraph(text: str) -> list[str]:
    return textwrap.wrap(text, LINE_WIDTH, break_long_words=False, break_on_hyphens=False)


def benchmarks_part(manifest: dict, grids: list[Grid]) -> str:
    out = paragraph("Generated by `python3 benchmarks/record.py` from the result sets `benchmarks/record.toml` "
                    "names: ms per token (median), in brackets its ratio to `full` at 100 % in the same grid. "
                    "`belady` is a replayed bound with no time: its hit rates are in each folder's `report.md`.")
    for grid in grids:
        out += ["", f"### {grid.title}", ""]
        out += paragraph(f"`{grid.results}`, code of `{grid.commit}`; {grid.machine}; {grid.hardware}. "
                         f"{grid.shows[0].upper()}{grid.shows[1:]}. Command: `{grid.command}`.") + [""]
        out += grid_table(grid, manifest["policies"]) + [""]
    return "\n".join(out).rstrip("\n")


def readme_part(manifest: dict, grids: list[Grid]) -> str:
    budget = float(manifest["readme_budget"])
    out = paragraph(f"ms per token with {percent(budget)} of the experts on the GPU (in brackets the ratio to `full` "
                    f"with all of them), code of `{grids[0].commit}` on {grids[0].machine.split(',')[0]}:")
    out += ["", "| policy | " + " | ".join(g.column for g in grids) + " |", "|---" * (len(grids) + 1) + "|",
           f"| `full` at 100 % | " + " | ".join(f"{g.ms[(REFERENCE, 1.0)]:.3f}" for g in grids) + " |"]
    for label in manifest["readme_policies"]:
        out.append(f"| {label} | " + " | ".join(cell(g, label, budget) for g in grids) + " |")
    return "\n".join(out)


def plot_series(manifest: dict, grid: Grid) -> dict[str, list[list[float]]]:
    return {label: [[b, round(grid.ms[(label, b)], 6)] for b in sorted(grid.budgets) if (label, b) in grid.ms]
            for label in grid.policies(manifest["policies"])}


def plot_digest(series: dict) -> str:
    return hashlib.sha256(json.dumps(series, sort_keys=True).encode()).hexdigest()


def draw_plot(grid: Grid, series: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=PLOT_SIZE_INCHES)
    for label, points in series.items():
        xs, ys = zip(*points)
        if label == REFERENCE:
            ax.axhline(ys[-1], color="black", linestyle="--", linewidth=1, label=f"{label} at 100 %")
            continue
        ax.plot([x * 100 for x in xs], ys, marker="o", linewidth=2.2 if label.startswith("oled") else 1.2,
                label=label)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("experts on the GPU (% of all)")
    ax.set_ylabel("ms per token (log scale)")
    ax.set_title(f"{grid.title} ({grid.machine.split(',')[0]}, {grid.commit})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI, metadata={PLOT_DIGEST_KEY: plot_digest(series), "Software": None})
    plt.close(fig)


def stored_digest(path: Path) -> str | None:
    if not path.is_file():
        return None
    with Image.open(path) as image:
        return image.info.get(PLOT_DIGEST_KEY)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- record:begin {name} -->", f"<!-- record:end {name} -->"


def split_part(text: str, name: str, where: str) -> tuple[str, str, str]:
    begin, end = markers(name)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise RecordError(f"{where}: needs one `{begin}` line before one `{end}` line")
    head, rest = text.split(begin)
    body, tail = rest.split(end)
    return head + begin + "\n", body.strip("\n"), "\n" + end + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated part is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this checkout)")
    args = parser.parse_args(argv)
    try:
        manifest, grids = load_manifest(args.root)
        by_name = {g.name: g for g in grids}
        if manifest.get("plot_grid") not in by_name:
            raise RecordError(f"{MANIFEST}: plot_grid names no [[grid]]")
        parts = [(BENCHMARKS_MD, BENCHMARKS_PART, benchmarks_part(manifest, grids)),
                 (README_MD, README_PART, readme_part(manifest, grids))]
        writes = {}
        for doc, name, body in parts:
            text = writes.get(doc) or (args.root / doc).read_text()
            head, old, tail = split_part(text, name, doc)
            if old != body:
                writes[doc] = head + body + tail
        plot_grid = by_name[manifest["plot_grid"]]
        series = plot_series(manifest, plot_grid)
        plot_path = args.root / manifest["plot_path"]
        redraw = stored_digest(plot_path) != plot_digest(series)
        stale = list(writes) + ([manifest["plot_path"]] if redraw else [])
        if not args.check:
            for doc, text in writes.items():
                (args.root / doc).write_text(text)
            if redraw:
                draw_plot(plot_grid, series, plot_path)
    except (RecordError, OSError, KeyError, tomllib.TOMLDecodeError) as e:
        print(f"record: {e}", file=sys.stderr)
        return 2
    if args.check:
        if stale:
            print("record: stale, run `python3 benchmarks/record.py`: " + ", ".join(stale), file=sys.stderr)
            return 1
        print("record: up to date")
        return 0
    print("record: wrote " + (", ".join(stale) if stale else "nothing (up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
