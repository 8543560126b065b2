"""One grid from the result lines of several `oled bench` folders, a later folder's run replacing an earlier one's of
the same run id (workload, policy, budget) and mode (live, bound); writes OUT/results.jsonl, OUT/sources.json
(where each run came from) and OUT/report.md (no plots). For a grid measured in parts: e.g. a full grid, then the
rows a later change affects.

    python benchmarks/merge_grids.py DIR [DIR ...] --out OUT
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from oled.bench.report import read_jsonl, render


def key(row: dict) -> tuple:
    return row["run_id"], row["mode"]          # workload|policy label|budget, and live or bound


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="folders holding results.jsonl (or results.jsonl.gz), earliest first")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    merged: dict[tuple, tuple[str, dict]] = {}
    for d in args.dirs:
        path = Path(d) / "results.jsonl"
        rows = read_jsonl(path)
        if not rows:
            ap.error(f"{path}: no result lines (nor in {path.name}.gz)")
        for row in rows:
            merged[key(row)] = (d, row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as f:
        for _, row in merged.values():
            f.write(json.dumps(row) + "\n")
    sources = [{"run": k[0], "mode": k[1], "from": d} for k, (d, _) in merged.items()]
    (out / "sources.json").write_text(json.dumps(sources, indent=1) + "\n")
    print(f"{len(merged)} runs from {len(args.dirs)} folders -> {render(out, plots=False)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
