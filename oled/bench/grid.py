"""The grid's bookkeeping: its policies and budgets, the result files, the messages and the progress bar, and the
rows that carry no timing (a replay's, a bound's). The runs themselves: live.py, replay_grid.py, bound_rows.py."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..decoding.params import DecodeParams
from ..env import now
from ..policies.spec import PolicySpec
from ..runtime.budget import BudgetError, parse_budget
from ..runtime.stats import RunStats
from .metrics import METRICS, aggregate

SCHEMA = "oled-bench/1"
ALL_KINDS = ("prefill", "iteration", "cache_fill")
OUTPUTS = ("results.jsonl", "skipped.jsonl", "iterations.jsonl")


class Grid:
    def __init__(self, cfg):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.specs = [PolicySpec.parse(p) for p in cfg.policies]
        if not self.specs:
            raise ValueError("no policies given")
        if not cfg.budgets:
            raise ValueError("no budgets given")
        if cfg.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {cfg.repeats}")
        self.rows: list[dict] = []
        self.skipped: list[dict] = []
        self.series: list[dict] = []
        self.bar = None

    # ---------------------------------------------------------------------------------------------- output
    def open_outputs(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in OUTPUTS:
            (self.out / name).write_text("")

    def append(self, name: str, obj: dict) -> None:
        with open(self.out / name, "a") as f:
            f.write(json.dumps(obj, default=json_default) + "\n")

    def say(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def skip(self, workload: str, spec: PolicySpec, budget: str, reason: str) -> None:
        self.say(f"skipping {spec.label} at budget {budget} on {workload}: {reason}")
        entry = {"workload": workload, "policy": spec.name, "policy_label": spec.label, "budget": budget,
                 "reason": reason}
        self.skipped.append(entry)
        self.append("skipped.jsonl", entry)

    def open_progress(self, total: int) -> None:
        if self.cfg.progress:
            self.bar = tqdm(total=total, unit="prompt", dynamic_ncols=True, leave=True)

    def close_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def tick(self, n: int = 1, desc: str | None = None) -> None:
        if self.bar is not None:
            if desc:
                self.bar.set_description(desc, refresh=False)
            self.bar.update(n)

    # ---------------------------------------------------------------------------------------------- the grid
    def combos(self) -> list[tuple[PolicySpec, str]]:
        combos = []
        for spec in self.specs:
            budgets = ["1.0"] if spec.static_full else self.budgets
            combos += [(spec, b) for b in budgets]
        return combos

    def check_budgets(self, num_layers: int, num_experts: int, expert_bytes: int) -> None:
        """Drop budgets that cannot run this model (too small, malformed), once, with the reason."""
        self.budgets = []
        self.num_experts, self.expert_bytes = num_experts, expert_bytes
        for b in self.cfg.budgets:
            try:
                parse_budget(b, num_layers=num_layers, num_experts=num_experts, expert_bytes=expert_bytes)
            except BudgetError as e:
                self.say(f"skipping budget {b} for every policy: {e}")
                entry = {"workload": "*", "policy": "*", "policy_label": "every policy", "budget": b,
                         "reason": str(e)}
                self.skipped.append(entry)
                self.append("skipped.jsonl", entry)
                continue
            self.budgets.append(b)

    def policy_options(self, spec: PolicySpec, popularity=None) -> dict:
        """The spec's options, with --tide-tau for a tide without its own and, for a fiddler without its own, the
        --popularity file, else `popularity` (calibrated on the workload or taken from the trace)."""
        options = dict(spec.options)
        engine = self.cfg.engine
        if spec.name == "tide" and "tau" not in options and engine.tide_tau is not None:
            options["tau"] = engine.tide_tau
        if spec.name == "fiddler" and "popularity" not in options:
            if engine.popularity:
                options["popularity"] = engine.popularity
            elif popularity is not None:
                options["popularity"] = popularity
        return options

    def add_simulated_row(self, mode, wl_name, workload, spec, options, budget, b, stats, metrics, *, model, engine,
                          decode, bench, prompts, extra=None) -> None:
        """A result line without timings (a bound or a replay): one pass, its statistics; `extra`: more fields."""
        row = {"schema": SCHEMA, "run_id": f"{wl_name}|{spec.label}|{budget}", "mode": mode, "status": "ok",
               "label": self.env["label"], "timestamp": now(), "workload": workload,
               "policy": spec.name, "policy_label": spec.label, "policy_options": options, "budget": budget,
               "budget_fraction": b.fraction, "slots_per_layer": b.slots_per_layer, "budget_bytes": b.bytes,
               "model": model, "engine": engine, "decode": decode,
               "bench": {"repeats": 1, "warmup_prompts": 0, "profiled_pass": False, **bench},
               "env": self.env, "metrics": {k: aggregate([metrics.get(k)]) for k in METRICS},
               "sections_per_iteration_ms": None, **(extra or {}),
               "stats_totals": stats.summary(kinds=ALL_KINDS).get("totals", {}) if stats is not None else {},
               "prompts": prompts}
        self.rows.append(row)
        self.append("results.jsonl", row)


def budget_key(b: str) -> float:
    try:
        return float(b.rstrip("%")) / (100 if b.endswith("%") else 1)
    except ValueError:
        return -1.0


def decode_dict(params: DecodeParams, engine) -> dict:
    d = {k: v for k, v in asdict(params).items() if k != "stop"}
    d["block_length"] = params.block_length or engine.config.block_length
    return d


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (Path, RunStats)):
        return str(o)
    return str(o)
