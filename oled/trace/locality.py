"""The locality report of a trace (docs/DESIGN.md, Metrics: "Locality").

Definitions (E_t = the set of experts a MoE layer uses in iteration t, over every token of the forward):
- unique experts per layer per iteration: |E_t|, over the denoising iterations (prefill and cache fills excluded).
- adjacent iterations: t and t+1 of the same block of the same request. Jaccard = |E_t & E_t+1| / |E_t | E_t+1|;
  recall = |E_t & E_t+1| / |E_t+1|, the hit rate a cache holding exactly E_t would get at t+1.
- block boundaries: the last iteration of a block and the first iteration of the next block of the same request.
- tokens per expert: for each layer, iteration and used expert, the number of tokens routed to it.
- token routing reuse: for a block position, the fraction of its top-k experts at t it uses again at t+1, by its
  state after iteration t: decoded earlier (or prompt), still masked, committed at t.
- confidence vs unchanged input. A position's input changes when it is committed. (a) same iteration: among
  positions masked at t, how well low confidence at t predicts "not committed at t" (input unchanged at t+1);
  (b) one step ahead: among positions still masked after t, how well low confidence at t predicts "still masked
  after t+1" (input unchanged at t+2), which is what a policy can use after iteration t. Both as AUC (0.5 = no
  information, 1 = perfect) and per confidence bin.
"""
from __future__ import annotations

import numpy as np

from ..policies.contract import IterationEvent
from .format import KINDS, Trace

CONF_EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
TOKEN_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, None))
STATE_NAMES = {IterationEvent.DECODED: "decoded earlier (or prompt)", IterationEvent.MASKED: "still masked",
               IterationEvent.COMMITTED: "committed at t"}


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """P(score of a positive > score of a negative), ties counted half (Mann-Whitney)."""
    labels = labels.astype(bool)
    n1, n0 = int(labels.sum()), int((~labels).sum())
    if n1 == 0 or n0 == 0:
        return None
    _, inv, counts = np.unique(scores, return_inverse=True, return_counts=True)
    starts = np.cumsum(counts) - counts
    ranks = (starts + (counts + 1) / 2.0)[inv]
    return float((ranks[labels].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def _pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _mean(values) -> float | None:
    return float(np.mean(values)) if len(values) else None


def run_index(trace: Trace) -> dict[tuple[int, int], int]:
    """(forward, MoE layer) -> the trace's run index."""
    return {(int(f), int(l)): i for i, (f, l) in enumerate(zip(trace.run_forward, trace.run_layer))}


def iteration_forwards(trace: Trace) -> list[int]:
    """The denoising iterations' forwards, in order (prefills and cache fills left out)."""
    return np.nonzero(trace.fwd_kind == KINDS.index("iteration"))[0].tolist()


def locality(trace: Trace) -> dict:
    t = trace
    layers = t.layers
    model = t.header["model"]
    k, E = model["top_k"], model["num_experts"]
    run_of = run_index(t)
    iter_fwds = iteration_forwards(t)

    sets: dict[tuple[int, int], np.ndarray] = {}
    unique = {l: [] for l in layers}
    tokens_per_expert = []
    for f in iter_fwds:
        for l in layers:
            i = run_of.get((f, l))
            if i is None:
                continue
            experts, counts = np.unique(t.run_ids(i), return_counts=True)
            sets[(f, l)] = experts
            unique[l].append(len(experts))
            tokens_per_expert.append(counts)
    tpe = np.concatenate(tokens_per_expert) if tokens_per_expert else np.zeros(0, dtype=np.int64)

    def overlap(fa, fb, l):
        a, b = sets.get((fa, l)), sets.get((fb, l))
        if a is None or b is None or not len(b):
            return None
        inter = len(np.intersect1d(a, b, assume_unique=True))
        return inter / len(np.union1d(a, b)), inter / len(b)

    within = {l: [] for l in layers}
    boundary = {l: [] for l in layers}
    reuse = {s: [] for s in STATE_NAMES}
    reuse_bins = [[] for _ in range(len(CONF_EDGES) - 1)]
    ahead_conf, ahead_label, same_conf, same_label = [], [], [], []
    n_within = n_boundary = 0
    V = len(t.ev_forward)
    for j in range(V):
        ev_state = t.ev_state[t.ev_offset[j]: t.ev_offset[j + 1]]
        ev_conf = t.ev_conf[t.ev_offset[j]: t.ev_offset[j + 1]]
        was_masked = ev_state != IterationEvent.DECODED
        same_conf.append(ev_conf[was_masked])
        same_label.append(ev_state[was_masked] == IterationEvent.MASKED)
        if j + 1 >= V:
            continue
        fa, fb = int(t.ev_forward[j]), int(t.ev_forward[j + 1])
        if t.fwd_request[fa] != t.fwd_request[fb]:
            continue
        same_block = t.ev_block[j] == t.ev_block[j + 1] and not t.ev_done[j]
        if not same_block:
            if t.ev_done[j]:
                n_boundary += 1
                for l in layers:
                    o = overlap(fa, fb, l)
                    if o is not None:
                        boundary[l].append(o)
            continue
        n_within += 1
        for l in layers:
            o = overlap(fa, fb, l)
            if o is not None:
                within[l].append(o)
        nxt_state = t.ev_state[t.ev_offset[j + 1]: t.ev_offset[j + 2]]
        still = ev_state == IterationEvent.MASKED
        if len(nxt_state) == len(ev_state):
            ahead_conf.append(ev_conf[still])
            ahead_label.append(nxt_state[still] == IterationEvent.MASKED)
        # per-token routing reuse: map the block's positions to rows of both forwards
        B = len(ev_state)
        bs = int(t.ev_block[j]) * B
        ra, rb = bs - int(t.fwd_start[fa]), bs - int(t.fwd_start[fb])
        if ra < 0 or rb < 0 or ra + B > t.fwd_tokens[fa] or rb + B > t.fwd_tokens[fb]:
            continue
        conf_bin = np.clip(np.searchsorted(CONF_EDGES, ev_conf, side="right") - 1, 0, len(CONF_EDGES) - 2)
        for l in layers:
            ia, ib = run_of.get((fa, l)), run_of.get((fb, l))
            if ia is None or ib is None:
                continue
            a, b = t.run_ids(ia)[ra: ra + B], t.run_ids(ib)[rb: rb + B]
            r = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1) / k
            for s in STATE_NAMES:
                reuse[s].append(r[ev_state == s])
            for bi in np.unique(conf_bin[still]).tolist():
                reuse_bins[bi].append(r[still & (conf_bin == bi)])

    def cat(chunks, dtype=np.float64):
        return np.concatenate(chunks).astype(dtype) if chunks else np.zeros(0, dtype=dtype)

    ahead_c, ahead_l = cat(ahead_conf), cat(ahead_label, bool)
    same_c, same_l = cat(same_conf), cat(same_label, bool)
    per_layer = []
    for l in layers:
        w, b = np.array(within[l]).reshape(-1, 2), np.array(boundary[l]).reshape(-1, 2)
        per_layer.append({"layer": l, "unique_experts": _mean(unique[l]),
                          "jaccard_adjacent": _mean(w[:, 0]), "recall_adjacent": _mean(w[:, 1]),
                          "jaccard_boundary": _mean(b[:, 0]), "recall_boundary": _mean(b[:, 1])})
    all_unique = [u for l in layers for u in unique[l]]
    all_w = np.array([o for l in layers for o in within[l]]).reshape(-1, 2)
    all_b = np.array([o for l in layers for o in boundary[l]]).reshape(-1, 2)
    buckets = []
    for lo, hi in TOKEN_BUCKETS:
        sel = (tpe >= lo) & ((tpe <= hi) if hi is not None else True)
        buckets.append({"tokens": f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi else f">={lo}"),
                        "experts": float(sel.mean()) if len(tpe) else None,
                        "pairs": float(tpe[sel].sum() / max(tpe.sum(), 1)) if len(tpe) else None})
    bins = []
    for bi in range(len(CONF_EDGES) - 1):
        lo, hi = CONF_EDGES[bi], CONF_EDGES[bi + 1]
        sel = (ahead_c >= lo) & ((ahead_c < hi) if bi < len(CONF_EDGES) - 2 else (ahead_c <= hi))
        rb = cat(reuse_bins[bi])
        bins.append({"confidence": [lo, hi], "tokens": int(sel.sum()),
                     "p_unchanged_next": float(ahead_l[sel].mean()) if sel.any() else None,
                     "routing_reuse": _mean(rb)})
    return {
        "trace": t.describe(),
        "num_experts": E, "top_k": k, "layers": layers,
        "iterations": len(iter_fwds), "adjacent_pairs": n_within, "boundary_pairs": n_boundary,
        "unique_experts_per_layer_iteration": {"mean": _mean(all_unique), "p10": _pct(all_unique, 10),
                                               "p50": _pct(all_unique, 50), "p90": _pct(all_unique, 90)},
        "adjacent": {"jaccard": _mean(all_w[:, 0]), "recall": _mean(all_w[:, 1])},
        "boundary": {"jaccard": _mean(all_b[:, 0]), "recall": _mean(all_b[:, 1])},
        "per_layer": per_layer,
        "tokens_per_expert": {"mean": _mean(tpe), "p50": _pct(tpe, 50), "p90": _pct(tpe, 90),
                              "max": int(tpe.max()) if len(tpe) else None, "buckets": buckets},
        "token_reuse": {STATE_NAMES[s]: {"mean": _mean(cat(reuse[s])), "tokens": int(sum(len(x) for x in reuse[s]))}
                        for s in STATE_NAMES},
        "confidence": {
            "same_iteration_auc": auc(-same_c, same_l), "same_iteration_tokens": int(len(same_c)),
            "next_iteration_auc": auc(-ahead_c, ahead_l), "next_iteration_tokens": int(len(ahead_c)),
            "p_unchanged_next": float(ahead_l.mean()) if len(ahead_l) else None,
            "bins": bins},
    }


def _f(v, fmt="{:.3f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def format_locality(rep: dict) -> str:
    u = rep["unique_experts_per_layer_iteration"]
    lines = [f"Trace: {rep['trace']}", "",
             f"Unique experts per layer per iteration: mean {_f(u['mean'], '{:.1f}')} of {rep['num_experts']} "
             f"(p10 {_f(u['p10'], '{:.0f}')}, p50 {_f(u['p50'], '{:.0f}')}, p90 {_f(u['p90'], '{:.0f}')}) over "
             f"{rep['iterations']} iterations",
             f"Adjacent iterations t -> t+1 (same block, {rep['adjacent_pairs']} pairs): "
             f"Jaccard {_f(rep['adjacent']['jaccard'])}, recall {_f(rep['adjacent']['recall'])}",
             f"Block boundaries (last iteration -> next block's first, {rep['boundary_pairs']} pairs): "
             f"Jaccard {_f(rep['boundary']['jaccard'])}, recall {_f(rep['boundary']['recall'])}",
             "  (recall = |E_t & E_t+1| / |E_t+1|: the hit rate of keeping exactly iteration t's experts)", "",
             "Per layer:",
             f"  {'layer':>5} {'unique/iter':>11} {'J adjacent':>10} {'R adjacent':>10} {'J boundary':>10} "
             f"{'R boundary':>10}"]
    for r in rep["per_layer"]:
        lines.append(f"  {r['layer']:>5} {_f(r['unique_experts'], '{:.1f}'):>11} {_f(r['jaccard_adjacent']):>10} "
                     f"{_f(r['recall_adjacent']):>10} {_f(r['jaccard_boundary']):>10} {_f(r['recall_boundary']):>10}")
    tpe = rep["tokens_per_expert"]
    lines += ["", f"Tokens per expert (per layer and iteration): mean {_f(tpe['mean'], '{:.2f}')}, "
                  f"median {_f(tpe['p50'], '{:.0f}')}, p90 {_f(tpe['p90'], '{:.0f}')}, max {tpe['max']}",
              "  tokens  " + "  ".join(f"{b['tokens']:>6}" for b in tpe["buckets"]),
              "  experts " + "  ".join(f"{_f(b['experts'], '{:.0%}'):>6}" for b in tpe["buckets"]),
              "  pairs   " + "  ".join(f"{_f(b['pairs'], '{:.0%}'):>6}" for b in tpe["buckets"]),
              "", "Token routing reuse t -> t+1 (share of a position's top-k experts used again), by state after t:"]
    for name, r in rep["token_reuse"].items():
        lines.append(f"  {name:<28} {_f(r['mean'])}  ({r['tokens']} position-layers)")
    c = rep["confidence"]
    lines += ["", "Confidence vs. input unchanged next iteration (AUC of low confidence; 0.5 = no information):",
              f"  same iteration  (masked at t -> not committed at t):        AUC {_f(c['same_iteration_auc'])} "
              f"over {c['same_iteration_tokens']} positions",
              f"  one step ahead  (still masked after t -> still after t+1):  AUC {_f(c['next_iteration_auc'])} "
              f"over {c['next_iteration_tokens']} positions; P(unchanged) {_f(c['p_unchanged_next'])}",
              f"  {'confidence at t':>16} {'positions':>9} {'P(still masked after t+1)':>26} {'routing reuse':>13}"]
    for b in c["bins"]:
        if b["tokens"] or b["routing_reuse"] is not None:
            lo, hi = b["confidence"]
            lines.append(f"  {f'[{lo:.2f}, {hi:.2f})':>16} {b['tokens']:>9} {_f(b['p_unchanged_next']):>26} "
                         f"{_f(b['routing_reuse']):>13}")
    return "\n".join(lines)
