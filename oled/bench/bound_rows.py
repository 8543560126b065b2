"""The bound rows of a grid (oled/bounds.py): at every budget, belady's fewest misses and, with a cost model, the
times, on the routing of the live grid's reference pass or of the replayed trace."""
from __future__ import annotations

import numpy as np

from ..bounds import CostTable, Demand, bound_rows
from ..runtime.cost_model import CostModel
from ..policies.spec import PolicySpec
from ..runtime.budget import parse_budget
from .grid import decode_dict

BOUND = "belady"      # the clairvoyant policy every replay grid carries (the exact bounds: oled/bounds.py)


def live_bound_rows(grid, engine, workload, model_info, reference) -> None:
    """The bounds on the routing of the reference pass (full residency, one pass over the workload): belady's fewest
    misses and, with the cost model measured at start-up (a CPU policy in the grid), the times, each MoE layer's
    compute being full's measured time a forward (its grid row, else the reference pass) split evenly over the MoE
    layers (attention, dense layers and head included)."""
    if reference is None or not reference.records:
        return
    c = engine.config
    demand = Demand.from_records(reference.records, list(c.moe_layers), c.top_k, reference.tokens)
    full = next((r for r in grid.rows if r["policy"] == "full" and r["workload"]["name"] == workload.name), None)
    forward_ms, compute = reference.forward_ms, "the reference pass's (one pass of full after a warm-up prompt)"
    if full is not None and (full["metrics"].get("ms_per_forward") or {}).get("median"):
        forward_ms, compute = full["metrics"]["ms_per_forward"]["median"], "full's grid row (median of repeats)"
    table = None
    if engine.costs is not None and forward_ms:
        table = CostTable.from_cost_model(engine.costs, forward_ms / 1e3 / len(c.moe_layers),
                                          demand.max_tokens, f"{engine.costs.source}; compute: {forward_ms:.4g} "
                                          f"ms a forward, {compute}, split evenly over the MoE layers")
    add_bound_rows(grid, workload.name, workload.describe(), demand, table, model_info, engine=None,
                   decode=decode_dict(grid.cfg.decode, engine), prompts=[],
                   timing="none (bounds on the reference pass's routing)")


def replay_bound_rows(grid, trace, costs, wl_name, wl, model, header) -> None:
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
        table = CostTable.from_cost_model(costs, compute, demand.max_tokens,
                                          f"{costs.source}; compute: the cost model's grouped GEMM of each "
                                          f"layer's experts (no attention)")
    add_bound_rows(grid, wl_name, wl, demand, table, model, engine=header.get("engine"),
                   decode=header.get("decode"), prompts=[], timing="none (bounds on the trace's routing)")


def add_bound_rows(grid, wl_name, workload, demand, table, model, *, engine, decode, prompts, timing) -> None:
    """One row per bound and budget (policy "bound:<kind>-<pool>", mode "bound"): ms per token as tpot_ms and the
    schedule's misses an iteration."""
    n_layers, E, size = len(demand.layers), grid.num_experts, grid.expert_bytes
    for budget in grid.budgets:
        b = parse_budget(budget, num_layers=n_layers, num_experts=E, expert_bytes=size)
        for bound in bound_rows(demand, b.slots_per_layer, table):
            metrics = {"tpot_ms": bound.ms_per_token, "misses_per_iteration": bound.misses_per_iteration,
                       "nfe": demand.iterations, "generated_tokens": demand.tokens}
            grid.add_simulated_row(
                "bound", wl_name, workload, PolicySpec(bound.name), {}, budget, b, None, metrics, model=model,
                engine=engine, decode=decode, prompts=prompts,
                bench={"seed": grid.cfg.engine.seed, "reference": None, "timing": timing, "bound": bound.definition},
                extra={"h2d_copy_gbps": None, "cost_model": None,
                       "cost_table": None if table is None else {
                           "link_ms": table.link_s * 1e3, "compute_ms": _ms(table.compute_s),
                           "source": table.source}})


def _ms(seconds):
    """Seconds (one figure or per layer) in milliseconds."""
    return {k: v * 1e3 for k, v in seconds.items()} if isinstance(seconds, dict) else seconds * 1e3

