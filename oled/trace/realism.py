"""The statistics that judge a trace's workload against the real model's (`oled trace --report`), per request and
over the whole trace, beside the published figures (oled/trace/published.py).

Only the denoising iterations count (prefills and cache fills are left out). For an iteration forward and a MoE
layer, c[e] is the number of the forward's rows routed to expert e (top-k, so a row counts for k experts), either
over every row of the forward ("forward rows": the rows it recomputes, which with a prefix cache include the previous
block's at a block's first iteration and with no cache the whole canvas) or over the rows of the block being decoded
("block rows").
- unique experts: |{e: c[e] > 0}| for a MoE layer and forward, the mean over layers and iterations.
- CV: for each MoE layer, the population standard deviation over the request's iterations of its unique experts
  (forward rows) divided by their mean; the mean over layers ("CV"), and model layer CV_LAYER's alone.
- tokens a forward: the request's output tokens over its iterations. The positions a block commits past the end of
  the generation (the last block's padding) are not tokens; cache fills are not iterations.
- cosine t+d: cos(c_t, c_t+d) of a MoE layer between iterations t and t+d of the same block of the same request,
  the mean over layers and such pairs, over block rows and over forward rows.
Over the whole trace: means over every layer and iteration (or pair) of every request, tokens over iterations
summed, and the CVs' mean over requests weighted by their iterations.
"""
from __future__ import annotations

import numpy as np

from .format import Trace
from .locality import iteration_forwards, run_index
from .published import PUBLISHED, published

CV_LAYER = 10           # the layer whose CV the published figure gives
LAGS = (1, 5)           # iterations apart for the cosine
ROWS = ("all", "block")
COLUMNS = (             # key, heading, format
    ("iterations", "iterations", "{:d}"),
    ("generated_tokens", "tokens", "{:d}"),
    ("tokens_per_forward", "tokens/forward", "{:.2f}"),
    ("unique_experts", "unique experts (forward rows)", "{:.1f}"),
    ("unique_experts_block", "unique experts (block rows)", "{:.1f}"),
    ("unique_cv", "CV (mean over layers)", "{:.1%}"),
    ("unique_cv_layer10", f"CV layer {CV_LAYER}", "{:.1%}"),
    ("cosine_1_block", "cos t+1 (block rows)", "{:.3f}"),
    ("cosine_5_block", "cos t+5 (block rows)", "{:.3f}"),
    ("cosine_1_all", "cos t+1 (forward rows)", "{:.3f}"),
    ("cosine_5_all", "cos t+5 (forward rows)", "{:.3f}"),
)


def expert_counts(trace: Trace, forwards: list[int]) -> dict[str, np.ndarray]:
    """Per forward of `forwards` and MoE layer, each expert's row count: {"all": [F, L, E], "block": [F, L, E]}."""
    E = int(trace.header["model"]["num_experts"])
    B = int(trace.header["decode"]["block_length"])
    run_of = run_index(trace)
    counts = {rows: np.zeros((len(forwards), len(trace.layers), E), dtype=np.int64) for rows in ROWS}
    for n, f in enumerate(forwards):
        first = int(trace.fwd_block_start[f]) - int(trace.fwd_start[f])    # the block's first row in the forward
        block = slice(max(first, 0), max(first + B, 0))
        for j, layer in enumerate(trace.layers):
            i = run_of.get((f, layer))
            if i is None:
                continue
            ids = trace.run_ids(i)
            for rows, chosen in (("all", ids), ("block", ids[block])):
                chosen = chosen[chosen >= 0].astype(np.int64)
                counts[rows][n, j] = np.bincount(chosen, minlength=E)
    return counts


def _cosines(counts: np.ndarray, blocks: np.ndarray, lag: int) -> np.ndarray:
    """cos(c_t, c_t+lag) for every layer and pair of forwards `lag` apart in the same block: [pairs * L]."""
    same = np.flatnonzero(blocks[:-lag] == blocks[lag:]) if len(blocks) > lag else np.zeros(0, dtype=np.int64)
    a, b = counts[same].astype(np.float64), counts[same + lag].astype(np.float64)
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    dots = (a * b).sum(-1)
    return (dots[norms > 0] / norms[norms > 0]).reshape(-1)


def _mean(values) -> float | None:
    return float(np.mean(values)) if len(values) else None


def request_statistics(trace: Trace, r: int, forwards: list[int], counts: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """Request r's statistics, and the raw values the whole trace's are pooled from."""
    mine = np.array([n for n, f in enumerate(forwards) if trace.fwd_request[f] == r], dtype=np.int64)
    blocks = trace.fwd_block_start[np.asarray(forwards, dtype=np.int64)[mine]] if len(mine) else np.zeros(0)
    unique = {rows: (counts[rows][mine] > 0).sum(-1) for rows in ROWS}       # [iterations, L]
    mean = unique["all"].mean(0) if len(mine) else np.zeros(0)
    cv = np.divide(unique["all"].std(0), mean, out=np.full(len(mean), np.nan), where=mean > 0) if len(mine) > 1 \
        else np.full(len(trace.layers), np.nan)
    layer10 = trace.layers.index(CV_LAYER) if CV_LAYER in trace.layers else None
    cos = {f"cosine_{lag}_{rows}": _cosines(counts[rows][mine], blocks, lag) for lag in LAGS for rows in ROWS}
    ids = trace.header.get("requests") or []
    tokens = int(len(trace.output_ids(r)))
    stats = {"request": str(ids[r]) if r < len(ids) else f"request-{r}", "iterations": int(len(mine)),
             "generated_tokens": tokens, "tokens_per_forward": tokens / len(mine) if len(mine) else None,
             "unique_experts": _mean(unique["all"]), "unique_experts_block": _mean(unique["block"]),
             "unique_cv": float(np.nanmean(cv)) if not np.isnan(cv).all() else None,
             "unique_cv_layer10": None if layer10 is None or np.isnan(cv[layer10]) else float(cv[layer10]),
             **{k: _mean(v) for k, v in cos.items()}}
    return stats, {"unique": unique, **cos}


def realism(trace: Trace) -> dict:
    """Per request and over the whole trace, the statistics of COLUMNS (None where a request has too few
    iterations for one)."""
    forwards = iteration_forwards(trace)
    counts = expert_counts(trace, forwards)
    per_request, raw = [], []
    for r in range(trace.num_requests):
        stats, values = request_statistics(trace, r, forwards, counts)
        per_request.append(stats)
        raw.append(values)
    iterations = sum(s["iterations"] for s in per_request)
    tokens = sum(s["generated_tokens"] for s in per_request)

    def weighted(key):
        pairs = [(s[key], s["iterations"]) for s in per_request if s[key] is not None]
        return sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else None

    overall = {"request": "all", "iterations": iterations, "generated_tokens": tokens,
               "tokens_per_forward": tokens / iterations if iterations else None,
               "unique_experts": _mean(np.concatenate([v["unique"]["all"].reshape(-1) for v in raw])),
               "unique_experts_block": _mean(np.concatenate([v["unique"]["block"].reshape(-1) for v in raw])),
               "unique_cv": weighted("unique_cv"), "unique_cv_layer10": weighted("unique_cv_layer10"),
               **{key: _mean(np.concatenate([v[key] for v in raw])) for key, _, _ in COLUMNS
                  if key.startswith("cosine_")}}
    decode = trace.header["decode"]
    return {"trace": trace.describe(), "block_length": decode.get("block_length"),
            "threshold": decode.get("threshold"), "cache": decode.get("cache"), "cv_layer": CV_LAYER,
            "requests": per_request, "overall": overall}


def _cell(value, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def _published_cells(model: str) -> list[str]:
    cells = []
    for key, _, _ in COLUMNS:
        p = published(key, model)
        cells.append(p.text("{:.0%}" if "cv" in key else "{:.3g}") if p else "")
    return cells


def _published_models() -> list[str]:
    return list(dict.fromkeys(p.model for p in PUBLISHED))


def sources() -> list[str]:
    """One line per published figure: the statistic, the value, where it was measured and its source."""
    heading = {key: (h, fmt) for key, h, fmt in COLUMNS}
    return [f"{p.model}, {heading[p.key][0]}: {p.text('{:.0%}' if 'cv' in p.key else '{:.3g}')} ({p.setting}; "
            f"{p.source})" for p in PUBLISHED]


def format_realism(rep: dict) -> str:
    """The statistics as a text table, a row per request, the whole trace's and the published figures'."""
    heads = ["request"] + [h for _, h, _ in COLUMNS]
    rows = [[s["request"]] + [_cell(s[k], fmt) for k, _, fmt in COLUMNS] for s in rep["requests"] + [rep["overall"]]]
    rows += [[f"{m} (published)"] + _published_cells(m) for m in _published_models()]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    lines = [f"Trace: {rep['trace']}",
             f"Statistics against the real model (block {rep['block_length']}, threshold {rep['threshold']}, cache "
             f"{rep['cache']}; iterations only; CV: std/mean of a layer's unique experts over the request's "
             f"iterations, forward rows):",
             "  " + "  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines + ["Published figures:"] + [f"  {s}" for s in sources()])


def markdown_table(reports: list[tuple[str, dict]]) -> str:
    """[(trace name, realism report)] as one Markdown table, every request and each trace's whole (the trace named on
    its first row), then the published figures' rows and their sources."""
    heads = ["trace", "request"] + [h for _, h, _ in COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for name, rep in reports:
        trace = f"`{name}` (block {rep['block_length']}, threshold {rep['threshold']}, cache {rep['cache']})"
        for n, s in enumerate(rep["requests"] + [rep["overall"]]):
            label = "**all**" if s is rep["overall"] else s["request"]
            cells = [trace if n == 0 else "", label] + [_cell(s[k], fmt) for k, _, fmt in COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    for m in _published_models():
        lines.append("| " + " | ".join([f"{m} (published)", ""] + _published_cells(m)) + " |")
    return "\n".join(lines + [""] + [f"- {s}" for s in sources()])
