"""The benchmark report: Markdown tables (one set per workload: policies as rows, budgets as columns, `full` in the
same table) and PNG plots, rendered from the JSON Lines of a benchmark directory alone.

    oled bench --render DIR      (re-render DIR/report.md and DIR/plots/ from DIR/results.jsonl)
"""
from __future__ import annotations

import json
from pathlib import Path

from ..textfile import read_results
from .metrics import METRICS

TABLES = ("tpot_ms", "tokens_per_s", "ms_per_forward", "misses_per_iteration", "hit_rate_tokens",
          "hit_rate_experts", "used_before_evicted", "cache_utilization", "hits_per_loaded_expert",
          "h2d_gb_per_iteration", "mapped_gb_per_iteration", "cpu_pairs_per_iteration",
          "cpu_ms_per_iteration",
          "cpu_cost_model_ratio", "cpu_path_cost_model_ratio", "unique_experts_per_layer_iteration", "token_agreement",
          "prefill_ms", "nfe", "tpf")
PERCENT = {"hit_rate_tokens", "hit_rate_experts", "cache_utilization", "token_agreement", "identical_outputs",
           "used_before_evicted"}
BREAKDOWN_LABELS = {"attention": "attention", "gpu_experts": "GPU experts", "copy_wait": "copy wait",
                    "cpu_experts": "CPU experts", "other": "other"}


def read_jsonl(path: Path) -> list[dict]:
    """The lines of a JSONL file, or of its gzipped copy (textfile.read_results); [] if there is neither."""
    try:
        text = read_results(path)
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load(out_dir) -> tuple[list[dict], list[dict], list[dict]]:
    out = Path(out_dir)
    rows = [r for r in read_jsonl(out / "results.jsonl") if r.get("status", "ok") == "ok"]
    return rows, read_jsonl(out / "skipped.jsonl"), read_jsonl(out / "iterations.jsonl")


# ------------------------------------------------------------------------------------------------- formatting
def fmt_value(key: str, v) -> str:
    if v is None:
        return "n/a"
    if key in PERCENT:
        return f"{v:.1%}"
    if key in ("nfe", "generated_tokens"):
        return f"{v:.0f}"
    if key == "tpot_ms" or key == "prefill_ms":
        return f"{v:.2f}" if v < 100 else f"{v:.1f}"
    return f"{v:.3g}"


def fmt_cell(key: str, m: dict | None) -> str:
    if not m or m.get("median") is None:
        return "n/a"
    text = fmt_value(key, m["median"])
    n = len([v for v in m.get("values", []) if v is not None])
    if n > 1 and m.get("spread") and m["spread"] > 1e-3 * abs(m["median"]):   # hide rounding-level spreads
        half = m["spread"] / 2
        text += f" ±{half:.1%}" if key in PERCENT else f" ±{fmt_value(key, half)}"
    return text


def _budget_columns(rows: list[dict]) -> list[tuple[str, str]]:
    cols: dict[str, tuple[float, str]] = {}
    for r in rows:
        E = r["model"]["num_experts"]
        cols.setdefault(r["budget"], (r["budget_fraction"], f"{r['budget_fraction']:.0%} ({r['slots_per_layer']}/{E})"))
    return [(b, head) for b, (_, head) in sorted(cols.items(), key=lambda kv: -kv[1][0])]


def _policies(rows: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in sorted(rows, key=lambda r: r["policy"] != "full"):
        if r["policy_label"] not in seen:
            seen.append(r["policy_label"])
    return seen


def metric_table(rows: list[dict], key: str) -> str | None:
    # the bound's rows (belady, replayed without timings) appear only where they have a value
    rows = [r for r in rows if r.get("mode") != "bound" or (r["metrics"].get(key) or {}).get("median") is not None]
    if all((r["metrics"].get(key) or {}).get("median") is None for r in rows):
        return None
    cols, pols = _budget_columns(rows), _policies(rows)
    cell = {(r["policy_label"], r["budget"]): r["metrics"].get(key) for r in rows}
    lines = ["| policy | " + " | ".join(h for _, h in cols) + " |", "|---|" + "---|" * len(cols)]
    for p in pols:
        lines.append(f"| {p} | " + " | ".join(fmt_cell(key, cell[(p, b)]) if (p, b) in cell else "—"
                                            for b, _ in cols) + " |")
    return "\n".join(lines)


def _workloads(rows: list[dict]) -> list[str]:
    out: list[str] = []
    for r in rows:
        if r["workload"]["name"] not in out:
            out.append(r["workload"]["name"])
    return out


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


# ---------------------------------------------------------------------------------------------------- report
def render(out_dir, breakdown: str | None = None, plots: bool = True) -> Path:
    """Write OUT/report.md (and OUT/plots/*.png) from OUT/results.jsonl, skipped.jsonl and iterations.jsonl."""
    out = Path(out_dir)
    rows, skipped, series = load(out)
    if not rows:
        raise ValueError(f"{out / 'results.jsonl'}: no results to report")
    images = make_plots(out, rows, series, breakdown) if plots else {}
    text = markdown(rows, skipped, images, series_entry=_pick_series(series, rows, breakdown))
    path = out / "report.md"
    path.write_text(text)
    return path


def markdown(rows: list[dict], skipped: list[dict] = (), images: dict | None = None, series_entry=None) -> str:
    images = images or {}
    first = rows[0]
    env, model, decode, bench = first["env"], first["model"], first.get("decode") or {}, first.get("bench", {})
    labels = sorted({r["label"] for r in rows})
    modes = sorted({r["mode"] for r in rows})
    git = env.get("git") or {}
    commit = (git.get("commit") or "unknown")[:12] + ("-dirty" if git.get("dirty") else "")
    v = env.get("versions", {})
    gpu = env.get("gpu")
    lines = ["# OLED-MoE benchmark report", "",
             f"- **Hardware**: {', '.join(labels)}"
             + (f" — {gpu['name']} ({gpu['memory_gib']} GiB)" if gpu else "")
             + f"; host CPU {env['cpu']['model']} ({env['cpu']['usable_cpus']} usable CPUs)",
             f"- **Software**: commit `{commit}`, oled {v.get('oled')}, torch {v.get('torch')}, "
             f"python {v.get('python')}, CUDA {v.get('cuda')}; {env.get('platform')}",
             f"- **Model**: {model['name']} ({model.get('model_type')}, {model.get('num_layers')} layers, "
             f"{model.get('num_experts')} experts per MoE layer, top-{model.get('top_k')}, "
             f"{model.get('expert_bytes', 0) / 2**20:.2f} MiB per expert)"
             + (f"; {model['note']}" if model.get("note") else ""),
             f"- **Decoding**: generation {decode.get('gen_length')} tokens, block {decode.get('block_length')}, "
             f"threshold {decode.get('threshold')}, cache {decode.get('cache')}, "
             f"temperature {decode.get('temperature')}",
             (f"- **Protocol**: mode {', '.join(modes)}; {bench.get('repeats')} repeat(s), "
              f"{bench.get('warmup_prompts')} warm-up prompt(s) excluded, seed {bench.get('seed')}, "
              f"timing: {bench.get('timing')}; cells are the median ± half the range over repeats"
              if modes != ["replay"] else
              f"- **Protocol**: replay of the trace `{first['workload'].get('trace')}` (recorded on "
              f"{bench.get('trace_recorded_on')}); deterministic, one pass per run, no timing"),
             f"- **Measured**: {min(r.get('timestamp') or '' for r in rows)} to "
             f"{max(r.get('timestamp') or '' for r in rows)} ({len(rows)} runs)"]
    if "CPU" in labels:
        lines += ["", "> **CPU run.** Timings labelled CPU come from a CPU-only machine; they say nothing about GPU "
                      "offloading performance. GPU figures come from the H200 benchmark machine only."]
    if "replay" in modes:
        lines += ["", "> **Replay.** Rows from `oled bench --replay` simulate the expert manager's bookkeeping on a "
                      "recorded routing trace: hit rates, loads, CPU pairs and H2D bytes are exact for that routing; "
                      "there are no timings. Prefetch uses " + str(bench.get("prediction")) + " predictions."]
    for wl in _workloads(rows):
        wrows = [r for r in rows if r["workload"]["name"] == wl]
        w = wrows[0]["workload"]
        prov = (w.get("provenance") or {})
        lines += ["", f"## Workload `{wl}`", "",
                  f"{w.get('num_prompts', len(w.get('prompt_ids', [])))} prompts; {prov.get('description', '')} "
                  f"Source: `{w.get('source', w.get('trace', ''))}`."
                  + (f" {w['truncated_prompts']} prompt(s) truncated to the model's context (last tokens kept)."
                     if w.get("truncated_prompts") else "")]
        refs = {r["bench"].get("reference") for r in wrows} - {None}
        if refs:
            lines.append(f"Token agreement is measured against the `{', '.join(sorted(refs))}` run.")
        for key in TABLES:
            table = metric_table(wrows, key)
            if table is None:
                continue
            label, unit, _ = METRICS[key]
            lines += ["", f"### {label}" + (f" ({unit})" if unit and key not in PERCENT else ""), "", table]
        for name in ("tpot", "hit_util", "h2d_cpu"):
            if (wl, name) in images:
                lines += ["", f"![{name} {wl}]({images[(wl, name)]})"]
    if series_entry is not None:
        lines += ["", "## Per-iteration time breakdown", "",
                  f"Run `{series_entry['policy_label']}` at budget {series_entry['budget']} on "
                  f"`{series_entry['workload']}` ({series_entry['label']}), one profiled pass: attention, GPU experts "
                  f"(grouped compute), copy wait (waiting for H2D copies), CPU experts (waiting for the CPU jobs) "
                  f"and other (everything else in the forward: routing, host round trips, shared expert, dense "
                  f"layer, LM head, Python).", "", breakdown_table(series_entry)]
        if ("breakdown", None) in images:
            lines += ["", f"![breakdown]({images[('breakdown', None)]})"]
    bounds = {r["policy"]: r["bench"]["bound"] for r in rows
              if r.get("mode") == "bound" and r["bench"].get("bound")}
    if bounds:
        tables = sorted({(r.get("cost_table") or {}).get("source") or "none: misses only"
                         for r in rows if r.get("mode") == "bound"})
        lines += ["", "## Bounds (oled/bounds.py)", "",
                  "Rows `bound:*`: computed from the routing, not run. `-even`: the budget split evenly across MoE "
                  "layers; `-shared`: one pool of the same slots for all MoE layers. Cost table: "
                  + "; ".join(tables) + ".", ""]
        lines += [f"- `{name}`: {definition}." for name, definition in sorted(bounds.items())]
    if skipped:
        lines += ["", "## Skipped runs", ""]
        lines += [f"- `{s['policy_label']}` at {s['budget']} on `{s['workload']}`: {s['reason']}" for s in skipped]
    lines += ["", "## Definitions (docs/DESIGN.md, Metrics)", ""]
    lines += [f"- **{label}**" + (f" ({unit})" if unit else "") + f": {definition}."
              for label, unit, definition in METRICS.values()]
    lines += ["- **Lossless check**: greedy outputs equal to `full` (token agreement 100 %)."]
    return "\n".join(lines) + "\n"


def breakdown_table(entry: dict) -> str:
    s = entry["series_ms"]
    n = len(s.get("wall", []))
    if not n:
        return ""
    mean = {k: sum(v) / n for k, v in s.items() if v}
    keys = [k for k in BREAKDOWN_LABELS if k in mean]
    total = sum(mean[k] for k in keys) or 1.0
    return ("| mean per iteration | " + " | ".join(BREAKDOWN_LABELS[k] for k in keys) + " | wall |\n|---|"
            + "---|" * (len(keys) + 1) + "\n| ms | " + " | ".join(f"{mean[k]:.3g}" for k in keys)
            + f" | {mean['wall']:.3g} |\n| share | " + " | ".join(f"{mean[k] / total:.0%}" for k in keys) + " | |")


def _pick_series(series: list[dict], rows: list[dict], breakdown: str | None):
    if not series:
        return None
    if breakdown:
        label, _, budget = breakdown.partition("@")
        for s in series:
            if s["policy_label"] == label and s["budget"] == budget:
                return s
    frac = {(r["policy_label"], r["budget"]): r["budget_fraction"] for r in rows}
    non_full = [s for s in series if s["policy_label"] != "full"] or series
    return min(non_full, key=lambda s: frac.get((s["policy_label"], s["budget"]), 1.0))


# ------------------------------------------------------------------------------------------------------ plots
def make_plots(out: Path, rows: list[dict], series: list[dict], breakdown: str | None = None) -> dict:
    import matplotlib  # optional: the bench extra
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the bench extra

    pdir = out / "plots"
    pdir.mkdir(parents=True, exist_ok=True)
    images = {}

    palette = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0", "C1", "C2", "C3", "C4", "C5"])
    order = [p for p in _policies(rows) if p != "full"]
    color = {p: palette[i % len(palette)] for i, p in enumerate(order)}

    def curves(ax, wrows, key, scale=1.0, style="-", suffix=""):
        drawn = False
        for p in _policies(wrows):
            pts = sorted(((r["budget_fraction"], r["metrics"].get(key) or {}) for r in wrows
                          if r["policy_label"] == p), key=lambda t: t[0])
            pts = [(x, m) for x, m in pts if m.get("median") is not None]
            if not pts:
                continue
            xs = [x * 100 for x, _ in pts]
            ys = [m["median"] * scale for _, m in pts]
            lo = [(m["median"] - m["min"]) * scale for _, m in pts]
            hi = [(m["max"] - m["median"]) * scale for _, m in pts]
            if p == "full" and len(xs) == 1:
                if style == "-":
                    ax.axhline(ys[0], color="black", linestyle=":", linewidth=1, label="full")
                ax.plot(xs, ys, "k*", markersize=10)
            else:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o" if style == "-" else "s", linestyle=style, capsize=3,
                            color=color.get(p), label=f"{p}{suffix}")
            drawn = True
        ax.set_xlabel("expert budget (% of routed-expert bytes)")
        ax.grid(True, alpha=0.3)
        return drawn

    for wl in _workloads(rows):
        wrows = [r for r in rows if r["workload"]["name"] == wl]
        label = wrows[0]["label"]
        tag = _safe(wl)
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        if curves(ax, wrows, "tpot_ms"):
            ax.set_ylabel("TPOT (ms)")
            ax.set_title(f"TPOT vs budget — {wl} [{label}]")
            ax.legend(fontsize=8)
            fig.tight_layout()
            name = f"plots/tpot_{tag}.png"
            fig.savefig(out / name, dpi=120)
            images[(wl, "tpot")] = name
        plt.close(fig)

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        curves(axes[0], wrows, "hit_rate_tokens", 100, "-", " (tokens)")
        curves(axes[0], wrows, "hit_rate_experts", 100, "--", " (experts)")
        axes[0].set_ylabel("hit rate (%)")
        axes[0].set_title(f"hit rate — {wl}")
        axes[0].legend(fontsize=7)
        curves(axes[1], wrows, "cache_utilization", 100)
        axes[1].set_ylabel("cache utilisation (%)")
        axes[1].set_title(f"cache utilisation — {wl}")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        name = f"plots/hit_util_{tag}.png"
        fig.savefig(out / name, dpi=120)
        images[(wl, "hit_util")] = name
        plt.close(fig)

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        curves(axes[0], wrows, "h2d_gb_per_iteration")
        axes[0].set_ylabel("H2D GB per iteration")
        axes[0].set_title(f"host-to-device copies — {wl}")
        axes[0].legend(fontsize=7)
        curves(axes[1], wrows, "cpu_pairs_per_iteration")
        axes[1].set_ylabel("CPU expert-token pairs per iteration")
        axes[1].set_title(f"CPU expert work — {wl}")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        name = f"plots/h2d_cpu_{tag}.png"
        fig.savefig(out / name, dpi=120)
        images[(wl, "h2d_cpu")] = name
        plt.close(fig)

    entry = _pick_series(series, rows, breakdown)
    if entry is not None and entry["series_ms"].get("wall"):
        s = entry["series_ms"]
        keys = [k for k in BREAKDOWN_LABELS if s.get(k)]
        n = len(s["wall"])
        fig, ax = plt.subplots(figsize=(max(6.5, min(16, n * 0.08)), 4.2))
        xs = list(range(n))
        if n <= 150:
            bottom = [0.0] * n
            for k in keys:
                ax.bar(xs, s[k], bottom=bottom, width=0.85, label=BREAKDOWN_LABELS[k])
                bottom = [b + v for b, v in zip(bottom, s[k])]
        else:
            ax.stackplot(xs, *[s[k] for k in keys], labels=[BREAKDOWN_LABELS[k] for k in keys])
        ax.set_xlabel("denoising iteration (in run order, all prompts)")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"per-iteration time — {entry['policy_label']} @ {entry['budget']}, {entry['workload']} "
                     f"[{entry['label']}]")
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        name = f"plots/breakdown_{_safe(entry['policy_label'])}_{_safe(entry['budget'])}_{_safe(entry['workload'])}.png"
        fig.savefig(out / name, dpi=120)
        images[("breakdown", None)] = name
        plt.close(fig)
    return images
