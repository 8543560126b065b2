"""The reuse predictor's report, from a trace: how well OLED's score ranks the experts the next iteration uses, and
what the retained sets hold, against lru, lfu, tide and the belady bound.

    oled trace --report TRACE --predictor [--budgets 0.6,0.4,0.25] [--json FILE]

Per budget and policy (replayed): the expert-weighted hit rate (the fraction of each iteration's needed experts
the retained set already held) and the token-weighted one. The ranking: after every iteration t followed by
another iteration of the same request, each (layer, expert) gets the predictor's score; the label is "used at
t+1". AUC overall and split by the states of the positions that routed to the expert at t (decoded earlier only,
any still masked, committed now only, not routed at t), beside the AUC of the plain token count at t (what tide
keeps by). And the host time the policy's bookkeeping takes per iteration.
"""
from __future__ import annotations

import time

import numpy as np

from ..policies import make_policy
from ..policies.contract import IterationEvent
from ..policies.reuse import ReuseCalibration, ReusePredictor
from .format import BEGIN, EVENT, REQUEST, RUN, Trace
from .locality import auc
from .replay import replay

POLICIES = ("oled", "oled-retain", "lru", "lfu", "tide", "belady")
GROUPS = ("decoded only", "any masked", "committed only", "not routed")


def _groups(ids: np.ndarray, rows: np.ndarray, positions: np.ndarray, state: np.ndarray, num_experts: int):
    """Per expert: which group the positions that routed to it at t put it in (index into GROUPS)."""
    g = np.full(num_experts, 3)
    has = {s: np.zeros(num_experts, bool) for s in (IterationEvent.DECODED, IterationEvent.MASKED,
                                                      IterationEvent.COMMITTED)}
    for r, p in zip(rows.tolist(), positions.tolist()):
        has[int(state[p])][ids[r]] = True
    routed = has[0] | has[1] | has[2]
    g[routed & has[IterationEvent.MASKED]] = 1
    g[routed & ~has[IterationEvent.MASKED] & has[IterationEvent.DECODED]] = 0
    g[routed & ~has[IterationEvent.MASKED] & ~has[IterationEvent.DECODED]] = 2
    return g


def ranking(trace: Trace, calibration=None) -> dict:
    """AUC of the predictor's scores (and of the token count at t) for "used at t+1", overall and by group."""
    model = trace.header["model"]
    E, layers = model["num_experts"], trace.layers
    pred = ReusePredictor(layers, E, ReuseCalibration.load(calibration))
    scores, counts, labels, groups = [], [], [], []
    pending = None          # (scores, counts, groups) per layer after an iteration, waiting for the next forward
    forward, current = -1, {}
    for op, arg in trace.ops.tolist():
        if op == REQUEST:
            pred.reset()
            pending = None
        elif op == BEGIN:
            forward += 1
            info = trace.forward_info(forward)
            pred.on_forward(info)
            current = {}
            if info.kind != "iteration":
                pending = None
        elif op == RUN:
            layer, ids = int(trace.run_layer[arg]), trace.run_ids(arg).astype(np.int64)
            pred.observe(layer, ids, trace.run_weights(arg))
            current[layer] = ids
            if pending is not None and layer in pending:
                s, c, g = pending.pop(layer)
                used = np.zeros(E, bool)
                used[ids[pred.row_positions()[0]].reshape(-1)] = True
                scores.append(s), counts.append(c), labels.append(used), groups.append(g)
        elif op == EVENT:
            event = trace.event(arg)
            rows, positions = pred.row_positions()
            pred.on_iteration(event)
            pending = {}
            for layer, ids in current.items():
                c = np.bincount(ids[rows].reshape(-1), minlength=E).astype(float)
                pending[layer] = (pred.layer_scores(layer).copy(), c,
                                  _groups(ids, rows, positions, event.state, E))
    if not labels:
        return {"pairs": 0}
    s, c, y, g = (np.concatenate(a) for a in (scores, counts, labels, groups))
    out = {"pairs": int(len(y)), "used_next": float(y.mean()), "auc": auc(s, y), "auc_token_count": auc(c, y),
           "groups": {}}
    for i, name in enumerate(GROUPS):
        m = g == i
        out["groups"][name] = {"experts": int(m.sum()), "used_next": float(y[m].mean()) if m.any() else None,
                               "auc": auc(s[m], y[m]) if m.any() else None,
                               "auc_token_count": auc(c[m], y[m]) if m.any() else None}
    return out


class _Timed:
    """A policy whose event calls are timed (the replay's host cost of its bookkeeping)."""

    def __init__(self, policy):
        self.__dict__["_policy"], self.__dict__["seconds"] = policy, 0.0

    def __getattr__(self, name):
        attr = getattr(self.__dict__["_policy"], name)
        if name not in ("decide", "on_iteration", "on_forward", "on_request_start"):
            return attr

        def timed(*args):
            t0 = time.perf_counter()
            try:
                return attr(*args)
            finally:
                self.__dict__["seconds"] += time.perf_counter() - t0
        return timed

    def __setattr__(self, name, value):
        setattr(self.__dict__["_policy"], name, value)


def predictor_report(trace: Trace, budgets=("0.6", "0.4", "0.25"), costs=None, calibration=None) -> dict:
    iterations = int((trace.fwd_kind == 1).sum())
    table = {}
    for budget in budgets:
        for name in POLICIES:
            policy = make_policy(name, calibration=calibration) if name.startswith("oled") else make_policy(name)
            timed = _Timed(policy)
            try:
                stats = replay(trace, timed, budget, costs).stats.summary()
            except (ValueError, RuntimeError) as e:      # e.g. cooperative without a cost model
                table[f"{name}@{budget}"] = {"error": str(e)}
                continue
            table[f"{name}@{budget}"] = {"policy": name, "budget": budget,
                                         "held_of_needed": stats["hit_rate_experts"],
                                         "hit_rate_tokens": stats["hit_rate_tokens"],
                                         "cache_utilization": stats["cache_utilization"],
                                         "host_us_per_iteration": timed.seconds / max(iterations, 1) * 1e6}
    return {"trace": trace.describe(), "iterations": iterations, "budgets": list(budgets),
            "ranking": ranking(trace, calibration), "retention": table}


def format_predictor_report(rep: dict) -> str:
    lines = [f"Reuse predictor on {rep['trace']}", ""]
    r = rep["ranking"]
    if r.get("pairs"):
        lines.append(f"Ranking next-iteration use ({r['pairs']} layer-expert cases, {r['used_next']:.1%} used next):"
                     f" AUC {r['auc']:.3f} (token count at t: {r['auc_token_count']:.3f})")
        lines.append(f"  {'experts routed at t by':<22}{'cases':>9}{'used next':>11}{'AUC':>8}{'count AUC':>11}")
        for name, g in r["groups"].items():
            f = lambda v, p: "n/a" if v is None else (f"{v:.1%}" if p else f"{v:.3f}")   # noqa: E731
            lines.append(f"  {name:<22}{g['experts']:>9}{f(g['used_next'], True):>11}{f(g['auc'], False):>8}"
                         f"{f(g['auc_token_count'], False):>11}")
        lines.append("")
    lines.append("Retained sets (replayed): share of each iteration's needed experts already held | token hit rate"
                 " | host µs per iteration")
    for budget in rep["budgets"]:
        cells = []
        for name in POLICIES:
            c = rep["retention"].get(f"{name}@{budget}", {})
            cells.append(f"{name} " + ("n/a" if "error" in c else
                                       f"{c['held_of_needed']:.1%} | {c['hit_rate_tokens']:.1%} | "
                                       f"{c['host_us_per_iteration']:.0f}"))
        lines.append(f"  {budget}: " + "; ".join(cells))
    return "\n".join(lines)
