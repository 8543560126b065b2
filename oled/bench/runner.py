"""`oled bench`: every policy x budget x workload side by side, in one process (docs/DESIGN.md, Benchmarking rules).

The model and the expert store are loaded once; each (policy, budget) gets a fresh expert manager through
Engine.set_runtime (the previous cache pool is freed first). Per workload, a reference pass with `full` (when every
expert fits) gives the reference tokens for the agreement metric and the expert popularity that `fiddler` places
(calibrated on the workload itself unless --popularity is given). Per (policy, budget): warm-up prompts (excluded),
then `repeats` timed passes over the same prompts with the same seed; median and spread over repeats. One extra
profiled pass (section timing) gives the per-iteration time breakdown of the chosen run (or of every run).

`--replay TRACE` runs the same grid on a recorded trace instead: hit rates, loads, CPU pairs and H2D bytes from a
CPU simulation of the manager's bookkeeping (no weights, no timing).

`--routing TRACE` runs the live grid on the model (e.g. random weights with a published model's shapes) with the
trace's routing and commits in place of its router's and its decoder's (oled/trace/source.py): the trace's requests
are the workload and its decoding settings are used, so every policy sees the recorded learned routing while the
experts are computed, copied and served at the model's real sizes.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import EngineConfig
from ..decoding.loop import generate
from ..decoding.params import DecodeParams
from ..bounds import CostTable, Demand, bound_rows
from ..decoding.procedure import usable_positions
from ..policies import policy_class, policy_options
from ..runtime.budget import BudgetError, parse_budget
from ..runtime.cost_model import CostModel
from ..runtime.stats import RunStats
from ..runtime.timer import SectionTimer
from ..trace.selection import sampled_requests
from . import workloads as wl_mod
from ..env import environment, now
from .metrics import METRICS, aggregate, repeat_metrics, stats_metrics

SCHEMA = "oled-bench/1"
ALL_KINDS = ("prefill", "iteration", "cache_fill")
BREAKDOWN = ("attention", "gpu_experts", "copy_wait", "cpu_experts", "other")


BOUND = "belady"      # the clairvoyant policy every replay grid carries (the exact bounds: oled/bounds.py)

# ------------------------------------------------------------------------------------------------ configuration
@dataclass
class PolicySpec:
    """`name` or `name:key=value[:key=value]` (e.g. tide:tau=2), options passed to make_policy."""
    name: str
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return f"{self.name}(" + ",".join(f"{k}={v}" for k, v in self.options.items()) + ")"

    @property
    def static_full(self) -> bool:
        return bool(getattr(policy_class(self.name), "static_full", False))

    @classmethod
    def parse(cls, text: str) -> "PolicySpec":
        name, *opts = text.strip().split(":")
        policy_class(name)                 # an unknown name is refused here, with the choices
        options = {}
        for opt in opts:
            key, eq, value = opt.partition("=")
            if not eq or not key:
                raise ValueError(f"policy {text!r}: options are written name:key=value (e.g. tide:tau=2)")
            accepted = policy_options(name)
            if key not in accepted:
                raise ValueError(f"policy {name!r} has no option {key!r} (options: {', '.join(accepted) or 'none'})")
            options[key] = _value(value)
        return cls(name, options)


def _value(text: str):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_list(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


@dataclass
class BenchConfig:
    policies: list[str] = field(default_factory=lambda: ["full", "lru"])
    budgets: list[str] = field(default_factory=lambda: ["1.0", "0.6", "0.4", "0.25"])
    workloads: list[str] = field(default_factory=lambda: ["code"])
    out: str = "oled-bench"
    # model (live mode)
    model: str | None = None
    random_weights: str | None = None
    layers: int | None = None
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    cpu_threads: int | None = None
    pin_memory: bool = True
    cuda_graphs: bool = True
    offload_graphs: bool = True
    mapped_misses: bool | None = None
    capture_slots: int = EngineConfig.capture_slots
    cpu_share: bool = EngineConfig.cpu_share
    shared_stream: bool = True
    shared_in_moe: bool = True
    fused: dict = field(default_factory=dict)        # EngineConfig's fused_* fields (the Triton kernels)
    cpu_kernel: dict = field(default_factory=dict)   # EngineConfig's cpu_* fields (the CPU kernel's knobs)
    # decoding and protocol
    decode: DecodeParams = field(default_factory=DecodeParams)
    prompts: int | None = None           # use at most this many prompts of each workload
    repeats: int = 3
    warmup: int = 1                      # warm-up prompts per run (excluded)
    tide_tau: int | None = None          # default tau for `tide` without an explicit option
    popularity: str | None = None        # fiddler: popularity file; default: calibrated on the workload
    breakdown: str | None = None         # POLICY@BUDGET whose per-iteration breakdown is plotted
    profile_all: bool = False            # profiled pass for every run (sections in every line)
    profile: bool = True                 # False: no profiled pass at all
    replay: str | None = None            # a trace file: replay instead of running the model
    routing: str | None = None           # a trace file: run the model with the trace's routing and commits
    cost_model: str | None = None        # replay: cost model JSON for cooperative policies (default: the trace's)
    progress: bool = True
    render: bool = True                  # write report.md and plots at the end
    bound: bool = True                   # add `belady` (the retention bound) at every budget


# ------------------------------------------------------------------------------------------------ the runner
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


class Bench:
    def __init__(self, cfg: BenchConfig):
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
        self._bar = None

    # ---------------------------------------------------------------------------------------------- output
    def _open_outputs(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in ("results.jsonl", "skipped.jsonl", "iterations.jsonl"):
            (self.out / name).write_text("")

    def _append(self, name: str, obj: dict) -> None:
        with open(self.out / name, "a") as f:
            f.write(json.dumps(obj, default=_json_default) + "\n")

    def _say(self, msg: str) -> None:
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def _skip(self, workload: str, spec: PolicySpec, budget: str, reason: str) -> None:
        self._say(f"skipping {spec.label} at budget {budget} on {workload}: {reason}")
        entry = {"workload": workload, "policy": spec.name, "policy_label": spec.label, "budget": budget,
                 "reason": reason}
        self.skipped.append(entry)
        self._append("skipped.jsonl", entry)

    def _tick(self, n: int = 1, desc: str | None = None) -> None:
        if self._bar is not None:
            if desc:
                self._bar.set_description(desc, refresh=False)
            self._bar.update(n)

    def _combos(self) -> list[tuple[PolicySpec, str]]:
        combos = []
        for spec in self.specs:
            budgets = ["1.0"] if spec.static_full else self.budgets
            combos += [(spec, b) for b in budgets]
        return combos

    def _check_budgets(self, num_layers: int, num_experts: int, expert_bytes: int) -> None:
        """Drop budgets that cannot run this model (too small, malformed), once, with the reason."""
        self.budgets = []
        self._num_experts, self._expert_bytes = num_experts, expert_bytes
        for b in self.cfg.budgets:
            try:
                parse_budget(b, num_layers=num_layers, num_experts=num_experts, expert_bytes=expert_bytes)
            except BudgetError as e:
                self._say(f"skipping budget {b} for every policy: {e}")
                entry = {"workload": "*", "policy": "*", "policy_label": "every policy", "budget": b,
                         "reason": str(e)}
                self.skipped.append(entry)
                self._append("skipped.jsonl", entry)
                continue
            self.budgets.append(b)

    def run(self) -> list[dict]:
        self._open_outputs()
        if self.cfg.replay:
            self._run_replay()
        else:
            self._run_live()
        if self.cfg.render and self.rows:
            from .report import render
            render(self.out)
        return self.rows

    # ------------------------------------------------------------------------------------------------ live
    def _run_live(self) -> None:
        from ..config import EngineConfig
        from ..engine import Engine

        cfg = self.cfg
        base = EngineConfig(model=cfg.model, random_weights=cfg.random_weights, layers=cfg.layers, seed=cfg.seed,
                            device=cfg.device, dtype=cfg.dtype, cpu_threads=cfg.cpu_threads,
                            pin_memory=cfg.pin_memory, cuda_graphs=cfg.cuda_graphs,
                            offload_graphs=cfg.offload_graphs, mapped_misses=cfg.mapped_misses,
                            capture_slots=cfg.capture_slots, cpu_share=cfg.cpu_share,
                            shared_stream=cfg.shared_stream,
                            shared_in_moe=cfg.shared_in_moe, **cfg.fused,
                            **cfg.cpu_kernel,
                            policy="lru",
                            expert_budget=self._smallest_budget_guess())
        engine = Engine(base, progress=cfg.progress)
        self.engine = engine
        self._check_budgets(len(engine.config.moe_layers), engine.config.num_experts, engine.store.expert_bytes)
        self.env = environment(engine.device)
        model_info = self._model_info(engine)
        if cfg.routing:
            workloads = [self._routing_workload(engine, model_info)]
            cfg = self.cfg
        else:
            workloads = [wl_mod.load(name, engine.tokenizer, cfg.prompts) for name in cfg.workloads]
        prompt_ids = {w.name: self._fit_prompts(engine, w) for w in workloads}
        combos = self._combos()
        chosen = self._chosen_breakdown(engine, combos)
        total = 0
        for w in workloads:
            n = len(prompt_ids[w.name][0])
            total += n  # reference pass
            for spec, budget in combos:
                prof = cfg.profile and (cfg.profile_all or (spec.label, budget) == chosen)
                total += min(cfg.warmup, n) + cfg.repeats * n + (n if prof else 0)
        self._bar = _progress(total, cfg.progress)
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
                        self._tick(planned)
                if cfg.bound:
                    self._bound_rows(engine, w, model_info)
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if engine.manager is not None:
                engine.manager.close()

    def _routing_workload(self, engine, model_info) -> "wl_mod.Workload":
        """--routing: the trace's requests as the workload, its decoding settings, its routing in the MoE layers."""
        from dataclasses import replace

        from ..trace import Trace
        from ..trace.source import TraceSource

        trace = Trace.load(self.cfg.routing)
        self.source = TraceSource(trace, engine.config, engine.device)
        engine.set_routing_source(self.source)
        self.cfg = replace(self.cfg, decode=self.source.decode_params())
        h = trace.header
        n, sample = sampled_requests(self.source.num_requests, self.cfg.prompts)
        ids = h.get("requests") or [f"request-{r}" for r in range(n)]
        prompts = [wl_mod.Prompt(str(ids[r]), token_ids=self.source.prompt_ids(r)) for r in range(n)]
        recorded = h["model"]
        model_info["routing"] = {"trace": str(self.cfg.routing), "model": recorded.get("name"),
                                 "workload": (h.get("workload") or {}).get("name"), "requests": n,
                                 "of_requests": self.source.num_requests, "sample": sample,
                                 "recorded_on": h.get("env", {}).get("label"), "date": h.get("date")}
        model_info["note"] = (f"routing and commits replayed from {self.cfg.routing} (learned routing of "
                              f"{recorded.get('name')}); "
                              + ("random expert weights" if engine.cfg.random_weights else "the model's weights")
                              + (f"; {sample}" if sample else ""))
        self._say(f"routing from {self.cfg.routing}: {trace.describe()}; decoding as recorded: "
                  f"{_decode_dict(self.cfg.decode, engine)}" + (f"; {sample}" if sample else ""))
        return wl_mod.Workload(f"routing:{Path(self.cfg.routing).stem}", str(self.cfg.routing), prompts,
                               {"trace": str(self.cfg.routing), "recorded": h.get("workload"), "sample": sample})

    def _smallest_budget_guess(self) -> str:
        """The engine starts with `lru` at one expert slot per layer (cheapest to allocate, always valid); each run
        replaces it. The number of experts comes from the preset or the checkpoint's config.json."""
        from ..engine import default_model_dir
        from ..models.config import config_from_dict
        from ..synth import preset_config

        cfg = self.cfg
        try:
            if cfg.random_weights:
                raw = preset_config(cfg.random_weights, cfg.layers)
            else:
                raw = json.loads((Path(cfg.model or default_model_dir()) / "config.json").read_text())
            return f"{150 / config_from_dict(raw).num_experts}%"
        except (OSError, ValueError, KeyError, TypeError):
            return min(cfg.budgets, key=lambda b: -_budget_key(b) if _budget_key(b) >= 0 else math.inf)

    def _chosen_breakdown(self, engine, combos) -> tuple[str, str] | None:
        if self.cfg.breakdown:
            label, _, budget = self.cfg.breakdown.partition("@")
            if not budget:
                raise ValueError(f"--breakdown {self.cfg.breakdown!r}: expected POLICY@BUDGET (e.g. lru@0.4)")
            if (label, budget) not in {(s.label, b) for s, b in combos}:
                raise ValueError(f"--breakdown {self.cfg.breakdown!r} is not one of the runs: "
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
        config, params = engine.config, self.cfg.decode
        limit = usable_positions(config, params.block_length or config.block_length) - params.gen_length
        if limit < 1:
            raise ValueError(f"--gen-length {params.gen_length} leaves no room for a prompt in the model's "
                             f"{config.max_position_embeddings} positions")
        out, truncated = [], 0
        for p in workload.prompts:
            ids = p.ids(engine.tokenizer)
            if len(ids) > limit:
                if self.cfg.routing:
                    raise ValueError(f"the trace's prompt {p.id} ({len(ids)} tokens) does not fit this model's "
                                     f"context with the recorded generation length")
                ids, truncated = ids[-limit:], truncated + 1
            out.append(ids)
        if truncated:
            self._say(f"workload {workload.name}: {truncated} prompt(s) longer than the model's context allows "
                      f"({limit} tokens with --gen-length {params.gen_length}) keep their last {limit} tokens")
        return out, truncated

    def _generate(self, engine, request: int, ids, stand_in=None, timer=None):
        """Prompt number `request` of the workload (its ids); under --routing, the trace's request of that number."""
        torch.manual_seed(self.cfg.seed)
        params = self.cfg.decode
        params.validate()
        commits = None
        if self.cfg.routing:
            commits = self.source
            commits.begin_request(request)
        if stand_in is None:
            return generate(engine.runner, ids, params, timer=timer, commits=commits)
        with engine.runner.borrowed(stand_in):        # e.g. a profiling probe around the manager
            return generate(engine.runner, ids, params, timer=timer, commits=commits)

    def _reference(self, engine, workload, prompts):
        """Reference tokens (full residency) and expert popularity for fiddler, from one untimed pass."""
        need_pop = any(s.name == "fiddler" and "popularity" not in s.options for s in self.specs) \
            and not self.cfg.popularity
        runs = [("full", "1.0")] + ([("lru", max(self.budgets, key=_budget_key))] if need_pop and self.budgets else [])
        for policy, budget in runs:
            try:
                engine.set_runtime(policy, budget)
            except (ValueError, RuntimeError) as e:
                self._say(f"reference pass with {policy} at {budget} not possible: {e}")
                continue
            results = []
            for i, ids in enumerate(prompts):
                results.append(self._generate(engine, i, ids))
                self._tick(1, f"{workload.name} reference ({policy})")
            tokens = [r.token_ids for r in results]
            popularity = None
            if need_pop:
                popularity = engine.manager.stats.popularity()
                self._write_popularity(engine, workload, popularity, policy)
            if policy == "full":
                self._reference_records = list(engine.manager.stats.records)
                self._reference_tokens = sum(len(t) for t in tokens)
                self._reference_forward_ms = (sum(r.decode_s for r in results) * 1e3
                                              / max(sum(r.nfe for r in results), 1))
            engine.manager.stats.reset()
            if policy == "full":
                return tokens, popularity, "full"
            return None, popularity, None
        return None, None, None

    def _bound_rows(self, engine, workload, model_info) -> None:
        """The bounds at every budget (oled/bounds.py) on the routing of the reference pass (full residency, one pass
        over the workload): belady's fewest misses and, with the cost model measured at start-up (a CPU policy in the
        grid), the times, each MoE layer's compute being full's measured time a forward (its grid row, else the
        reference pass) split evenly over the MoE layers (attention, dense layers and head included)."""
        records = getattr(self, "_reference_records", None)
        if not records:
            return
        c = engine.config
        demand = Demand.from_records(records, list(c.moe_layers), c.top_k, self._reference_tokens)
        full = next((r for r in self.rows if r["policy"] == "full" and r["workload"]["name"] == workload.name), None)
        forward_ms, compute = self._reference_forward_ms, "the reference pass's (one untimed-protocol pass of full)"
        if full is not None and (full["metrics"].get("ms_per_forward") or {}).get("median"):
            forward_ms, compute = full["metrics"]["ms_per_forward"]["median"], "full's grid row (median of repeats)"
        table = None
        if engine.costs is not None and forward_ms:
            table = CostTable.from_cost_model(engine.costs, forward_ms / 1e3 / len(c.moe_layers),
                                              _max_tokens(demand), f"{engine.costs.source}; compute: {forward_ms:.4g} "
                                              f"ms a forward, {compute}, split evenly over the MoE layers")
        self._add_bound_rows(workload.name, workload.describe(), demand, table, model_info, engine=None,
                             decode=_decode_dict(self.cfg.decode, engine), prompts=[],
                             timing="none (bounds on the reference pass's routing)")

    def _add_bound_rows(self, wl_name, workload, demand, table, model, *, engine, decode, prompts, timing) -> None:
        """One row per bound and budget (policy "bound:<kind>-<pool>", mode "bound"): ms per token as tpot_ms and the
        schedule's misses an iteration."""
        n_layers, E, size = len(demand.layers), self._num_experts, self._expert_bytes
        for budget in self.budgets:
            b = parse_budget(budget, num_layers=n_layers, num_experts=E, expert_bytes=size)
            for bound in bound_rows(demand, b.slots_per_layer, table):
                metrics = {"tpot_ms": bound.ms_per_token, "misses_per_iteration": bound.misses_per_iteration,
                           "nfe": demand.iterations, "generated_tokens": demand.tokens}
                self._add_simulated_row(
                    "bound", wl_name, workload, PolicySpec(bound.name), {}, budget, b, None, metrics, model=model,
                    engine=engine, decode=decode, prompts=prompts,
                    bench={"seed": self.cfg.seed, "reference": None, "timing": timing, "bound": bound.definition},
                    extra={"h2d_copy_gbps": None, "cost_model": None,
                           "cost_table": None if table is None else {
                               "link_ms": table.link_s * 1e3, "compute_ms": _ms(table.compute_s),
                               "source": table.source}})

    def _add_simulated_row(self, mode, wl_name, workload, spec, options, budget, b, stats, metrics, *, model, engine,
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
        self._append("results.jsonl", row)

    def _write_popularity(self, engine, workload, popularity, policy) -> None:
        try:
            from ..policies.fiddler import popularity_document
            doc = popularity_document(popularity, {"model": engine.model_name, "workload": workload.name,
                                                   "policy": policy, "date": now(),
                                                   "counts": "tokens per expert over every forward of the "
                                                             "benchmark's reference pass on this workload"})
        except ImportError:
            doc = {"layers": popularity}
        path = self.out / f"popularity-{_safe(workload.name)}.json"
        path.write_text(json.dumps(doc, default=_json_default) + "\n")

    def _measure(self, engine, workload, prompts, truncated, spec, budget, reference, ref_note, popularity, prof,
                 model_info):
        cfg = self.cfg
        options = dict(spec.options)
        if spec.name == "tide" and "tau" not in options and cfg.tide_tau is not None:
            options["tau"] = cfg.tide_tau
        if spec.name == "fiddler" and "popularity" not in options:
            if cfg.popularity:
                options["popularity"] = cfg.popularity
            elif popularity is not None:
                options["popularity"] = popularity
        try:
            engine.set_runtime(spec.name, budget, **options)
        except ImportError as e:
            self._skip(workload.name, spec, budget, f"a component it needs is missing ({e})")
            return None
        except (ValueError, RuntimeError, OSError) as e:
            self._skip(workload.name, spec, budget, str(e))
            return None
        run_id = f"{workload.name}|{spec.label}|{budget}"
        desc = f"{workload.name} {spec.label}@{budget}"
        try:
            for i, ids in enumerate(prompts[: cfg.warmup]):
                self._generate(engine, i, ids)
                self._tick(1, f"{desc} warm-up")
            per_repeat, last = [], None
            for r in range(cfg.repeats):
                engine.manager.stats.reset()
                results = []
                for i, ids in enumerate(prompts):
                    results.append(self._generate(engine, i, ids))
                    self._tick(1, f"{desc} repeat {r + 1}/{cfg.repeats}")
                per_repeat.append(repeat_metrics(results, engine.manager.stats.summary(), reference))
                last = results
            if reference is None and ref_note is None and last is not None:
                reference, ref_note = [r.token_ids for r in last], f"{spec.label}@{budget}"
            sections = copy_gbps = None
            if prof:
                sections, copy_gbps = self._profiled_pass(engine, prompts, run_id, workload.name, spec, budget, desc)
        except (ValueError, RuntimeError) as e:
            self._skip(workload.name, spec, budget, f"failed while running: {e}")
            return None
        metrics = {k: aggregate([m.get(k) for m in per_repeat]) for k in METRICS}
        b = engine.budget
        row = {
            "schema": SCHEMA, "run_id": run_id, "mode": "live", "status": "ok", "label": self.env["label"],
            "timestamp": now(),
            "workload": dict(workload.describe(), truncated_prompts=truncated),
            "policy": spec.name, "policy_label": spec.label,
            "policy_options": {k: ("calibrated on the workload (reference pass)" if k == "popularity"
                                   and not isinstance(v, (str, Path)) else v) for k, v in options.items()},
            "budget": budget, "budget_fraction": b.fraction, "slots_per_layer": b.slots_per_layer,
            "budget_bytes": b.bytes,
            "model": model_info,
            "engine": dict(engine.cfg.to_dict(), policy=spec.name, expert_budget=budget, profile=False),
            "decode": _decode_dict(cfg.decode, engine),
            "bench": {"repeats": cfg.repeats, "warmup_prompts": min(cfg.warmup, len(prompts)), "seed": cfg.seed,
                      "reference": ref_note, "profiled_pass": bool(prof),
                      "timing": "CUDA events and wall clock" if engine.device.type == "cuda" else "wall clock (CPU)"},
            "env": self.env,
            "metrics": metrics,
            "sections_per_iteration_ms": sections,
            "h2d_copy_gbps": copy_gbps,     # profiled pass, CUDA only: the copy path's achieved bandwidth
            # the measured miss-service costs the runtime predicts CPU jobs with (CPU policies only)
            "cost_model": engine.manager.costs.to_dict() if engine.manager.costs is not None else None,
            "stats_totals": engine.manager.stats.summary(kinds=ALL_KINDS).get("totals", {}),
            "prompts": [{"id": p.id, "prompt_tokens": len(ids), "generated_tokens": len(r.token_ids), "nfe": r.nfe,
                         "tpot_ms": r.tpot_s * 1e3, "prefill_ms": r.prefill_s * 1e3, "finish_reason": r.finish_reason,
                         "matches_reference": (r.token_ids == reference[i]) if reference is not None else None}
                        for i, (p, ids, r) in enumerate(zip(workload.prompts, prompts, last))],
        }
        self.rows.append(row)
        self._append("results.jsonl", row)
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
                self._tick(1, f"{desc} profiled")
        finally:
            engine.manager.timer = None
        series = iteration_breakdown(probe.rows)
        copy_s = sum(sec.get("h2d_copy", 0.0) for _, _, sec in probe.rows)
        # achieved bandwidth of the copy path: expert bytes over the copy stream's busy time (all forwards)
        copy_gbps = (copied() - bytes_before) / copy_s / 1e9 if copy_s > 0 else None
        entry = {"run_id": run_id, "workload": workload, "policy_label": spec.label, "budget": budget,
                 "label": self.env["label"], "series_ms": series}
        self.series.append(entry)
        self._append("iterations.jsonl", entry)
        return {k: (float(np.mean(v)) if v else 0.0) for k, v in series.items()}, copy_gbps

    @staticmethod
    def _model_info(engine) -> dict:
        c = engine.config
        return {"name": engine.model_name, "model_type": c.model_type, "num_layers": c.num_layers,
                "moe_layers": len(c.moe_layers), "num_experts": c.num_experts, "top_k": c.top_k,
                "expert_bytes": engine.store.expert_bytes, "total_expert_bytes": engine.store.host_bytes,
                "non_expert_bytes": engine.non_expert_bytes, "random_weights": engine.cfg.random_weights,
                "dtype": str(engine.dtype).replace("torch.", ""),
                "triton_kernels": [name.removeprefix("fused_") for name, on in engine.kernels.items() if on],
                "note": ("random weights: routing differs from a trained model" if engine.cfg.random_weights
                         else None)}

    # ---------------------------------------------------------------------------------------------- replay
    def _replay_mapped_rows(self) -> int | None:
        """BenchConfig.mapped_misses for a replay: None follows the recording, else on (the fused kernels' block
        of pairs) or off."""
        if self.cfg.mapped_misses is None:
            return None
        from ..kernels.triton_moe import mapped_rows

        return mapped_rows(self.cfg.mapped_misses)

    def _replay_bound_rows(self, trace, costs, wl_name, wl, model, header) -> None:
        """The bounds of a replay grid: on its cost model (--cost-model, else the trace's), each MoE layer's compute
        being the cost model's grouped GEMM of the layer's experts (mean over its iterations: the experts' GPU compute
        alone, no attention: no forward was timed); with no cost model, belady's misses only."""
        demand = Demand.from_trace(trace)
        if costs is None and header.get("costs"):
            costs = CostModel.from_dict(header["costs"])
        table = None
        if costs is not None:
            compute = {}
            for layer in demand.layers:
                runs = [run for run in demand.runs if run.timed and run.layer == layer]
                compute[layer] = float(np.mean([costs.gpu_expert_seconds_of(run.tokens).sum() for run in runs])
                                       if runs else 0.0)
            table = CostTable.from_cost_model(costs, compute, _max_tokens(demand),
                                              f"{costs.source}; compute: the cost model's grouped GEMM of each "
                                              f"layer's experts (no attention)")
        self._add_bound_rows(wl_name, wl, demand, table, model, engine=header.get("engine"),
                             decode=header.get("decode"), prompts=[], timing="none (bounds on the trace's routing)")

    def _run_replay(self) -> None:
        from ..trace import Trace, replay

        cfg = self.cfg
        trace = Trace.load(cfg.replay)
        n, sample = sampled_requests(trace.num_requests, cfg.prompts)
        trace = trace.first_requests(n)
        if sample:
            self._say(f"replay of {cfg.replay}: {sample}")
        costs = CostModel.from_json(Path(cfg.cost_model).read_text()) if cfg.cost_model else None
        self.env = dict(environment("cpu"), label="replay (CPU)")
        h = trace.header
        model = dict(h["model"], note="; ".join(filter(None, [
            "random weights: routing differs from a trained model" if h["model"].get("random_weights") else None,
            sample])) or None)
        wl = dict(h.get("workload") or {"name": "trace"}, trace=str(cfg.replay), sample=sample)
        wl_name = wl.get("name", "trace")
        iters = int((trace.fwd_kind == 1).sum())
        committed = int((trace.ev_state == 2).sum())
        generated = int(len(trace.req_output_ids))
        self._check_budgets(len(trace.layers), h["model"]["num_experts"], h["model"]["expert_bytes"])
        combos = self._combos()
        if cfg.bound and not any(spec.name == BOUND for spec, _ in combos):
            combos += [(PolicySpec(BOUND), b) for b in self.budgets]
        self._bar = _progress(len(combos), cfg.progress)
        try:
            for spec, budget in combos:
                options = dict(spec.options)
                if spec.name == "tide" and "tau" not in options and cfg.tide_tau is not None:
                    options["tau"] = cfg.tide_tau
                if spec.name == "fiddler" and "popularity" not in options:
                    options["popularity"] = cfg.popularity or trace.popularity()
                try:
                    mgr = replay(trace, spec.name, budget, costs, mapped_rows=self._replay_mapped_rows(), **options)
                except (ValueError, RuntimeError) as e:
                    self._skip(wl_name, spec, budget, str(e))
                    self._tick(1)
                    continue
                m = stats_metrics(mgr.stats.summary())
                m.update({"nfe": iters, "tpf": committed / max(iters, 1), "generated_tokens": generated})
                self._add_simulated_row(
                    "replay", wl_name, wl, spec,
                    {k: ("from the trace's routing" if k == "popularity" and not isinstance(v, (str, Path)) else v)
                     for k, v in options.items()},
                    budget, mgr.budget, mgr.stats, m, model=model, engine=h.get("engine"), decode=h.get("decode"),
                    bench={"seed": None, "reference": None, "timing": "none (replay)", "prediction": mgr.prediction,
                           "trace_recorded_on": h.get("env", {}).get("label")},
                    prompts=[{"id": pid, "prompt_tokens": int(len(trace.prompt_ids(i))),
                              "generated_tokens": int(len(trace.output_ids(i)))}
                             for i, pid in enumerate(h.get("requests", []))])
                self._tick(1, f"replay {spec.label}@{budget}")
            if cfg.bound:
                self._replay_bound_rows(trace, costs, wl_name, wl, model, h)
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


def _ms(seconds):
    """Seconds (one figure or per layer) in milliseconds."""
    return {k: v * 1e3 for k, v in seconds.items()} if isinstance(seconds, dict) else seconds * 1e3


def _max_tokens(demand: Demand) -> int:
    return max((int(run.tokens.max()) for run in demand.runs if len(run.tokens)), default=1)


def _budget_key(b: str) -> float:
    try:
        return float(b.rstrip("%")) / (100 if b.endswith("%") else 1)
    except ValueError:
        return -1.0


def _decode_dict(params: DecodeParams, engine) -> dict:
    d = {k: v for k, v in asdict(params).items() if k != "stop"}
    d["block_length"] = params.block_length or engine.config.block_length
    return d


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="prompt", dynamic_ncols=True, leave=True)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (Path, RunStats)):
        return str(o)
    return str(o)


def run_bench(cfg: BenchConfig) -> list[dict]:
    return Bench(cfg).run()
