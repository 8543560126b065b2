"""The live grid: the model loaded once, each (policy, budget) on a fresh expert manager (Engine.set_runtime), timed.

Per workload, a reference pass with `full` (when every expert fits) gives the reference tokens for the agreement
metric and the expert popularity that `fiddler` places (calibrated on the workload itself unless --popularity is
given). Per (policy, budget): warm-up prompts (excluded), then `repeats` timed passes over the same prompts with the
same seed; median and spread over repeats. One extra profiled pass (section timing) gives the per-iteration time
breakdown of the chosen run (or of every run). With --routing the trace's routing and commits replace the router's
and the decoder's (oled/trace/source.py).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..decoding.loop import generate
from ..decoding.procedure import usable_positions
from ..engine import Engine, default_model_dir
from ..env import environment, now, peak_memory
from ..models.config import config_from_dict
from ..policies.fiddler import popularity_document
from ..runtime.budget import BudgetError, parse_budget
from ..runtime.timer import SectionTimer
from ..synth import preset_config
from ..trace import Trace
from ..trace.selection import sampled_requests
from ..trace.source import TraceSource
from . import workloads as wl_mod
from .bound_rows import live_bound_rows
from .grid import ALL_KINDS, SCHEMA, budget_key, decode_dict, json_default, safe_name
from .metrics import METRICS, aggregate, repeat_metrics

BREAKDOWN = ("attention", "gpu_experts", "copy_wait", "cpu_experts", "other")


@dataclass
class ReferencePass:
    """full's pass over a workload (after a warm-up prompt where no `full` row is timed): its routing records, the
    tokens it generated, its ms per forward."""
    records: list
    tokens: int
    forward_ms: float


class _ForwardProbe:
    """Stands in for the manager in the decoding loop during a profiled pass: section times and wall time per
    forward (the timer synchronises once per forward, at its end)."""

    def __init__(self, manager, timer: SectionTimer):
        self.manager, self.timer = manager, timer
        self.rows: list[tuple[str, float, dict]] = []
        self._kind, self._t0 = "iteration", 0.0

    def __getattr__(self, name):
        return getattr(self.__dict__["manager"], name)

    def begin_forward(self, info) -> None:
        self.timer.collect()
        self._kind, self._t0 = info.kind, time.perf_counter()
        self.manager.begin_forward(info)

    def end_forward(self) -> None:
        self.manager.end_forward()
        sections = self.timer.collect()
        self.rows.append((self._kind, time.perf_counter() - self._t0, sections))


def iteration_breakdown(rows) -> dict[str, list[float]]:
    """Per denoising iteration, milliseconds: attention, GPU experts, copy wait, CPU experts, other (= wall - rest)
    plus the wall time and the other named sections."""
    series = {k: [] for k in (*BREAKDOWN, "wall", "moe", "dense_mlp", "lm_head", "h2d_copy")}
    for kind, wall, sec in rows:
        if kind != "iteration":
            continue
        named = sum(sec.get(k, 0.0) for k in BREAKDOWN[:-1])
        for k in BREAKDOWN[:-1]:
            series[k].append(sec.get(k, 0.0) * 1e3)
        series["other"].append(max(wall - named, 0.0) * 1e3)
        series["wall"].append(wall * 1e3)
        for k in ("moe", "dense_mlp", "lm_head", "h2d_copy"):   # h2d_copy overlaps compute: not in "other"
            series[k].append(sec.get(k, 0.0) * 1e3)
    return series

class LiveRuns:
    """The live grid of one Grid (its configuration, rows and messages)."""

    def __init__(self, grid):
        self.grid = grid
        self.engine = None
        self.source = None                     # --routing: the trace's routing and commits
        self.reference_pass: ReferencePass | None = None

    def run(self) -> None:
        cfg = self.grid.cfg
        # the grid's engine settings; each run sets its own policy and budget, and its options (Grid.policy_options)
        base = replace(cfg.engine, policy="lru", expert_budget=self._smallest_budget_guess(), tide_tau=None,
                       popularity=None)
        start = time.perf_counter()
        engine = Engine(base, progress=cfg.progress)
        load_seconds = time.perf_counter() - start
        self.engine = engine
        self.grid.check_budgets(len(engine.config.moe_layers), engine.config.num_experts, engine.store.expert_bytes)
        self.grid.env = environment(engine.device)
        # the load: its time (random weights made, FP8 quantised, the store pinned) and the memory it left
        model_info = dict(self._model_info(engine), load_seconds=load_seconds,
                          memory_after_load=peak_memory(engine.device))
        if cfg.routing:
            workloads = [self._routing_workload(engine, model_info)]
            cfg = self.grid.cfg
        else:
            workloads = [wl_mod.load(name, engine.tokenizer, cfg.prompts) for name in cfg.workloads]
        prompt_ids = {w.name: self._fit_prompts(engine, w) for w in workloads}
        combos = self.grid.combos()
        chosen = self._chosen_breakdown(engine, combos)
        total = 0
        for w in workloads:
            n = len(prompt_ids[w.name][0])
            total += n + (1 if self._reference_times_bounds() else 0)  # reference pass (and its warm-up)
            for spec, budget in combos:
                prof = cfg.profile and (cfg.profile_all or (spec.label, budget) == chosen)
                total += min(cfg.warmup, n) + cfg.repeats * n + (n if prof else 0)
        self.grid.open_progress(total)
        try:
            for w in workloads:
                ids, truncated = prompt_ids[w.name]
                reference, popularity, ref_note = self._reference(engine, w, ids)
                for spec, budget in combos:
                    n = len(ids)
                    prof = cfg.profile and (cfg.profile_all or (spec.label, budget) == chosen)
                    planned = min(cfg.warmup, n) + cfg.repeats * n + (n if prof else 0)
                    row = self._measure(engine, w, ids, truncated, spec, budget, reference, ref_note, popularity,
                                        prof, model_info)
                    if row is None:
                        self.grid.tick(planned)
                if cfg.bound:
                    live_bound_rows(self.grid, engine, w, model_info, self.reference_pass)
        finally:
            self.grid.close_progress()
            if engine.manager is not None:
                engine.manager.close()

    def _routing_workload(self, engine, model_info) -> "wl_mod.Workload":
        """--routing: the trace's requests as the workload, its decoding settings, its routing in the MoE layers."""
        trace = Trace.load(self.grid.cfg.routing)
        self.source = TraceSource(trace, engine.config, engine.device)
        engine.set_routing_source(self.source)
        self.grid.cfg = replace(self.grid.cfg, decode=self.source.decode_params())
        h = trace.header
        n, sample = sampled_requests(self.source.num_requests, self.grid.cfg.prompts)
        ids = h.get("requests") or [f"request-{r}" for r in range(n)]
        prompts = [wl_mod.Prompt(str(ids[r]), token_ids=self.source.prompt_ids(r)) for r in range(n)]
        recorded = h["model"]
        model_info["routing"] = {"trace": str(self.grid.cfg.routing), "model": recorded.get("name"),
                                 "workload": (h.get("workload") or {}).get("name"), "requests": n,
                                 "of_requests": self.source.num_requests, "sample": sample,
                                 "recorded_on": h.get("env", {}).get("label"), "date": h.get("date")}
        model_info["note"] = (f"routing and commits replayed from {self.grid.cfg.routing} (learned routing of "
                              f"{recorded.get('name')}); "
                              + ("random expert weights" if engine.cfg.random_weights else "the model's weights")
                              + (f"; {sample}" if sample else ""))
        self.grid.say(f"routing from {self.grid.cfg.routing}: {trace.describe()}; decoding as recorded: "
                  f"{decode_dict(self.grid.cfg.decode, engine)}" + (f"; {sample}" if sample else ""))
        return wl_mod.Workload(f"routing:{Path(self.grid.cfg.routing).stem}", str(self.grid.cfg.routing), prompts,
                               {"trace": str(self.grid.cfg.routing), "recorded": h.get("workload"), "sample": sample})

    def _smallest_budget_guess(self) -> str:
        """The engine starts with `lru` at one expert slot per layer (cheapest to allocate, always valid); each run
        replaces it. The number of experts comes from the preset or the checkpoint's config.json."""
        cfg = self.grid.cfg
        try:
            if cfg.engine.random_weights:
                raw = preset_config(cfg.engine.random_weights, cfg.engine.layers)
            else:
                raw = json.loads((Path(cfg.engine.model or default_model_dir()) / "config.json").read_text())
            return f"{150 / config_from_dict(raw).num_experts}%"
        except (OSError, ValueError, KeyError, TypeError):
            return min(cfg.budgets, key=lambda b: -budget_key(b) if budget_key(b) >= 0 else math.inf)

    def _chosen_breakdown(self, engine, combos) -> tuple[str, str] | None:
        if self.grid.cfg.breakdown:
            label, _, budget = self.grid.cfg.breakdown.partition("@")
            if not budget:
                raise ValueError(f"--breakdown {self.grid.cfg.breakdown!r}: expected POLICY@BUDGET (e.g. lru@0.4)")
            if (label, budget) not in {(s.label, b) for s, b in combos}:
                raise ValueError(f"--breakdown {self.grid.cfg.breakdown!r} is not one of the runs: "
                                 f"{', '.join(f'{s.label}@{b}' for s, b in combos)}")
            return label, budget
        cands = [(s, b) for s, b in combos if not s.static_full] or combos

        def fraction(b):
            try:
                return parse_budget(b, num_layers=len(engine.config.moe_layers), num_experts=engine.config.num_experts,
                                    expert_bytes=engine.store.expert_bytes).fraction
            except BudgetError:
                return math.inf
        spec, budget = min(cands, key=lambda sb: (fraction(sb[1]), cands.index(sb)))
        return spec.label, budget

    def _fit_prompts(self, engine, workload) -> tuple[list[list[int]], int]:
        """Token ids of the prompts; a prompt too long for the model's context (with the generation, padded to
        blocks for LLaDA2) keeps its last tokens."""
        config, params = engine.config, self.grid.cfg.decode
        limit = usable_positions(config, params.block_length or config.block_length) - params.gen_length
        if limit < 1:
            raise ValueError(f"--gen-length {params.gen_length} leaves no room for a prompt in the model's "
                             f"{config.max_position_embeddings} positions")
        out, truncated = [], 0
        for p in workload.prompts:
            ids = p.ids(engine.tokenizer)
            if len(ids) > limit:
                if self.grid.cfg.routing:
                    raise ValueError(f"the trace's prompt {p.id} ({len(ids)} tokens) does not fit this model's "
                                     f"context with the recorded generation length")
                ids, truncated = ids[-limit:], truncated + 1
            out.append(ids)
        if truncated:
            self.grid.say(f"workload {workload.name}: {truncated} prompt(s) longer than the model's context allows "
                      f"({limit} tokens with --gen-length {params.gen_length}) keep their last {limit} tokens")
        return out, truncated

    def _generate(self, engine, request: int, ids, stand_in=None, timer=None):
        """Prompt number `request` of the workload (its ids); under --routing, the trace's request of that number."""
        torch.manual_seed(self.grid.cfg.engine.seed)
        params = self.grid.cfg.decode
        params.validate()
        commits = None
        if self.grid.cfg.routing:
            commits = self.source
            commits.begin_request(request)
        if stand_in is None:
            return generate(engine.runner, ids, params, timer=timer, commits=commits)
        with engine.runner.borrowed(stand_in):        # e.g. a profiling probe around the manager
            return generate(engine.runner, ids, params, timer=timer, commits=commits)

    def _reference(self, engine, workload, prompts):
        """Reference tokens (full residency) and expert popularity for fiddler, from one untimed pass."""
        need_pop = any(s.name == "fiddler" and "popularity" not in s.options for s in self.grid.specs) \
            and not self.grid.cfg.engine.popularity
        budgets = self.grid.budgets
        runs = [("full", "1.0")] + ([("lru", max(budgets, key=budget_key))] if need_pop and budgets else [])
        for policy, budget in runs:
            try:
                engine.set_runtime(policy, budget)
            except (ValueError, RuntimeError) as e:
                self.grid.say(f"reference pass with {policy} at {budget} not possible: {e}")
                continue
            if policy == "full" and self._reference_times_bounds() and prompts:
                self._generate(engine, 0, prompts[0])      # compiles and captures, so the timed pass below is warm
                engine.manager.stats.reset()
                self.grid.tick(1, f"{workload.name} reference warm-up")
            results = []
            for i, ids in enumerate(prompts):
                results.append(self._generate(engine, i, ids))
                self.grid.tick(1, f"{workload.name} reference ({policy})")
            tokens = [r.token_ids for r in results]
            popularity = None
            if need_pop:
                popularity = engine.manager.stats.popularity()
                self._write_popularity(engine, workload, popularity, policy)
            if policy == "full":
                self.reference_pass = ReferencePass(list(engine.manager.stats.records), sum(len(t) for t in tokens),
                                                    sum(r.decode_s for r in results) * 1e3
                                                    / max(sum(r.nfe for r in results), 1))
            engine.manager.stats.reset()
            if policy == "full":
                return tokens, popularity, "full"
            return None, popularity, None
        return None, None, None

    def _reference_times_bounds(self) -> bool:
        """Whether the bound rows take their compute from the reference pass: no `full` row will be timed."""
        return self.grid.cfg.bound and not any(s.name == "full" for s in self.grid.specs)

    def _write_popularity(self, engine, workload, popularity, policy) -> None:
        try:
            doc = popularity_document(popularity, {"model": engine.model_name, "workload": workload.name,
                                                   "policy": policy, "date": now(),
                                                   "counts": "tokens per expert over every forward of the "
                                                             "benchmark's reference pass on this workload"})
        except ImportError:
            doc = {"layers": popularity}
        path = self.grid.out / f"popularity-{safe_name(workload.name)}.json"
        path.write_text(json.dumps(doc, default=json_default) + "\n")

    def _measure(self, engine, workload, prompts, truncated, spec, budget, reference, ref_note, popularity, prof,
                 model_info):
        cfg = self.grid.cfg
        options = self.grid.policy_options(spec, popularity)
        try:
            engine.set_runtime(spec.name, budget, **options)
        except ImportError as e:
            self.grid.skip(workload.name, spec, budget, f"a component it needs is missing ({e})")
            return None
        except (ValueError, RuntimeError, OSError) as e:
            self.grid.skip(workload.name, spec, budget, str(e))
            return None
        run_id = f"{workload.name}|{spec.label}|{budget}"
        desc = f"{workload.name} {spec.label}@{budget}"
        try:
            for i, ids in enumerate(prompts[: cfg.warmup]):
                self._generate(engine, i, ids)
                self.grid.tick(1, f"{desc} warm-up")
            per_repeat, last = [], None
            for r in range(cfg.repeats):
                engine.manager.stats.reset()
                results = []
                for i, ids in enumerate(prompts):
                    results.append(self._generate(engine, i, ids))
                    self.grid.tick(1, f"{desc} repeat {r + 1}/{cfg.repeats}")
                per_repeat.append(repeat_metrics(results, engine.manager.stats.summary(), reference))
                last = results
            if reference is None and ref_note is None and last is not None:
                reference, ref_note = [r.token_ids for r in last], f"{spec.label}@{budget}"
            sections = copy_gbps = None
            if prof:
                sections, copy_gbps = self._profiled_pass(engine, prompts, run_id, workload.name, spec, budget, desc)
        except (ValueError, RuntimeError) as e:
            self.grid.skip(workload.name, spec, budget, f"failed while running: {e}")
            return None
        metrics = {k: aggregate([m.get(k) for m in per_repeat]) for k in METRICS}
        b = engine.budget
        row = {
            "schema": SCHEMA, "run_id": run_id, "mode": "live", "status": "ok", "label": self.grid.env["label"],
            "timestamp": now(),
            "workload": dict(workload.describe(), truncated_prompts=truncated),
            "policy": spec.name, "policy_label": spec.label,
            "policy_options": {k: ("calibrated on the workload (reference pass)" if k == "popularity"
                                   and not isinstance(v, (str, Path)) else v) for k, v in options.items()},
            "budget": budget, "budget_fraction": b.fraction, "slots_per_layer": b.slots_per_layer,
            "budget_bytes": b.bytes,
            "model": model_info,
            "engine": dict(engine.cfg.to_dict(), policy=spec.name, expert_budget=budget, profile=False),
            "decode": decode_dict(cfg.decode, engine),
            "bench": {"repeats": cfg.repeats, "warmup_prompts": min(cfg.warmup, len(prompts)), "seed": cfg.engine.seed,
                      "reference": ref_note, "profiled_pass": bool(prof),
                      "timing": "CUDA events and wall clock" if engine.device.type == "cuda" else "wall clock (CPU)"},
            "env": self.grid.env,
            "metrics": metrics,
            "sections_per_iteration_ms": sections,
            "memory": peak_memory(engine.device),       # the process's peaks up to this row
            "h2d_copy_gbps": copy_gbps,     # profiled pass, CUDA only: the copy path's achieved bandwidth
            # the measured miss-service costs the runtime predicts CPU jobs with (CPU policies only)
            "cost_model": engine.manager.costs.to_dict() if engine.manager.costs is not None else None,
            "stats_totals": engine.manager.stats.summary(kinds=ALL_KINDS).get("totals", {}),
            "prompts": [{"id": p.id, "prompt_tokens": len(ids), "generated_tokens": len(r.token_ids), "nfe": r.nfe,
                         "tpot_ms": r.tpot_s * 1e3, "prefill_ms": r.prefill_s * 1e3, "finish_reason": r.finish_reason,
                         "matches_reference": (r.token_ids == reference[i]) if reference is not None else None}
                        for i, (p, ids, r) in enumerate(zip(workload.prompts, prompts, last))],
        }
        self.grid.rows.append(row)
        self.grid.append("results.jsonl", row)
        return row

    def _profiled_pass(self, engine, prompts, run_id, workload, spec, budget, desc) -> tuple[dict, float | None]:
        """Mean milliseconds per iteration of each section, and the copy path's achieved GB/s (None without CUDA)."""
        timer = SectionTimer(engine.device)
        engine.manager.timer = timer
        probe = _ForwardProbe(engine.manager, timer)
        copied = lambda: sum(r.bytes_h2d for r in engine.manager.stats.records)   # noqa: E731
        bytes_before = copied()
        try:
            for i, ids in enumerate(prompts):
                self._generate(engine, i, ids, stand_in=probe, timer=timer)
                self.grid.tick(1, f"{desc} profiled")
        finally:
            engine.manager.timer = None
        series = iteration_breakdown(probe.rows)
        copy_s = sum(sec.get("h2d_copy", 0.0) for _, _, sec in probe.rows)
        # achieved bandwidth of the copy path: expert bytes over the copy stream's busy time (all forwards)
        copy_gbps = (copied() - bytes_before) / copy_s / 1e9 if copy_s > 0 else None
        entry = {"run_id": run_id, "workload": workload, "policy_label": spec.label, "budget": budget,
                 "label": self.grid.env["label"], "series_ms": series}
        self.grid.series.append(entry)
        self.grid.append("iterations.jsonl", entry)
        return {k: (float(np.mean(v)) if v else 0.0) for k, v in series.items()}, copy_gbps

    @staticmethod
    def _model_info(engine) -> dict:
        c = engine.config
        return {"name": engine.model_name, "model_type": c.model_type, "num_layers": c.num_layers,
                "moe_layers": len(c.moe_layers), "num_experts": c.num_experts, "top_k": c.top_k,
                "expert_bytes": engine.store.expert_bytes, "total_expert_bytes": engine.store.host_bytes,
                "expert_dtype": engine.store.expert_dtype,
                "non_expert_bytes": engine.non_expert_bytes, "random_weights": engine.cfg.random_weights,
                "dtype": str(engine.dtype).replace("torch.", ""),
                "triton_kernels": [name.removeprefix("fused_") for name, on in engine.kernels.items() if on],
                "note": ("random weights: routing differs from a trained model" if engine.cfg.random_weights
                         else None)}
