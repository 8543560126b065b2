"""The replay grid (`oled bench --replay TRACE`): hit rates, loads, CPU pairs and H2D bytes of each (policy, budget)
from a CPU simulation of the manager's bookkeeping on a recorded trace (no weights, no timing)."""
from __future__ import annotations

from pathlib import Path

from ..env import environment
from ..kernels.triton_moe import mapped_rows
from ..policies.spec import PolicySpec
from ..runtime.cost_model import CostModel
from ..trace import Trace, replay
from ..trace.selection import sampled_requests
from .bound_rows import BOUND, replay_bound_rows
from .metrics import stats_metrics


def run_replay(grid) -> None:
    """The grid over the trace of --replay: a CPU simulation of the manager's bookkeeping per (policy, budget)."""
    cfg = grid.cfg
    trace = Trace.load(cfg.replay)
    n, sample = sampled_requests(trace.num_requests, cfg.prompts)
    trace = trace.first_requests(n)
    if sample:
        grid.say(f"replay of {cfg.replay}: {sample}")
    costs = CostModel.from_file(cfg.cost_model) if cfg.cost_model else None    # JSON, or a grid's results.jsonl[.gz]
    grid.env = dict(environment("cpu"), label="replay (CPU)")
    h = trace.header
    model = dict(h["model"], note="; ".join(filter(None, [
        "random weights: routing differs from a trained model" if h["model"].get("random_weights") else None,
        sample])) or None)
    wl = dict(h.get("workload") or {"name": "trace"}, trace=str(cfg.replay), sample=sample)
    wl_name = wl.get("name", "trace")
    iters = int((trace.fwd_kind == 1).sum())
    committed = int((trace.ev_state == 2).sum())
    generated = int(len(trace.req_output_ids))
    grid.check_budgets(len(trace.layers), h["model"]["num_experts"], h["model"]["expert_bytes"])
    combos = grid.combos()
    if cfg.bound and not any(spec.name == BOUND for spec, _ in combos):
        combos += [(PolicySpec(BOUND), b) for b in grid.budgets]
    grid.open_progress(len(combos))
    try:
        for spec, budget in combos:
            options = grid.policy_options(spec, trace.popularity() if spec.name == "fiddler" else None)
            try:
                mgr = replay(trace, spec.name, budget, costs, mapped_rows=_mapped_rows(cfg.engine.offload), **options)
            except (ValueError, RuntimeError) as e:
                grid.skip(wl_name, spec, budget, str(e))
                grid.tick(1)
                continue
            m = stats_metrics(mgr.stats.summary())
            m.update({"nfe": iters, "tpf": committed / max(iters, 1), "generated_tokens": generated})
            grid.add_simulated_row(
                "replay", wl_name, wl, spec,
                {k: ("from the trace's routing" if k == "popularity" and not isinstance(v, (str, Path)) else v)
                 for k, v in options.items()},
                budget, mgr.budget, mgr.stats, m, model=model, engine=h.get("engine"), decode=h.get("decode"),
                bench={"seed": None, "reference": None, "timing": "none (replay)", "prediction": mgr.prediction,
                       "trace_recorded_on": h.get("env", {}).get("label")},
                prompts=[{"id": pid, "prompt_tokens": int(len(trace.prompt_ids(i))),
                          "generated_tokens": int(len(trace.output_ids(i)))}
                         for i, pid in enumerate(h.get("requests", []))])
            grid.tick(1, f"replay {spec.label}@{budget}")
        if cfg.bound:
            replay_bound_rows(grid, trace, costs, wl_name, wl, model, h)
    finally:
        grid.close_progress()


def _mapped_rows(offload) -> int | None:
    """OffloadConfig.mapped_misses for a replay: None follows the recording, else on (the fused kernels'
    block of pairs) or off."""
    if offload.mapped_misses is None:
        return None
    return mapped_rows(offload.mapped_misses)
