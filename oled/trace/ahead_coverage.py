"""`oled trace --report TRACE --ahead`: how far copying the next iteration's misses during the current one could go,
replayed on the CPU. On the mapped path an iteration's misses are read from host memory inside its MoE layers, in
series with their compute; whatever the host could name one iteration ahead could instead be copied into slots while
the current forward runs. Per (policy, budget) and per prediction, over the mapped iterations: the misses, the share
of them the prediction names, the experts it names that are not resident (what a prefetch would copy) and the share
of those the layer then does not need, and both in GB per iteration at --expert-mib. The predictions use only what
the host knows after an iteration:
  recent:W  the experts the layer used in the W iterations before, that are not resident now;
  block     at a block's first iteration only: the experts the layer used at the previous block's first iteration;
  both      their union (recent at the widest W given);
  token     for each row whose input token changed since the layer's last iteration (a position committed then):
            the experts that token id used at the layer in the request's earlier forwards (prefill included): a
            per-request token prior; masked rows and unchanged rows name nothing;
  token+recent  token's experts with recent's at the widest W.
The token predictions need the iterations' tokens (traces recorded since they carry them); with them, each result
also says which rows use the misses, as fractions of the misses that overlap (an expert may serve several kinds of
row): masked rows, rows whose input token is new since the layer's last iteration, rows unchanged (the prompt's,
tokens decoded earlier). Counts only, no timing.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from ..kernels.triton_moe import mapped_rows
from ..policies.base import IterationEvent
from .format import BEGIN, EVENT, REQUEST, Trace
from .replay import replay_manager


def row_tokens(trace: Trace) -> list[np.ndarray]:
    """Per forward, the input token of each row: the prompt's, a token committed by an earlier iteration's event, or
    the mask id."""
    mask = int(trace.header["model"]["mask_token_id"])
    out, known, prompt, forward = [], {}, np.zeros(0, dtype=np.int64), -1
    for op, arg in trace.ops.tolist():
        if op == REQUEST:
            known, prompt = {}, trace.prompt_ids(arg)
        elif op == BEGIN:
            forward += 1
            start = int(trace.fwd_start[forward])
            out.append(np.array([int(prompt[p]) if p < len(prompt) else known.get(p, mask)
                                 for p in range(start, start + int(trace.fwd_tokens[forward]))], dtype=np.int64))
        elif op == EVENT:
            event = trace.event(arg)
            block_start = int(trace.fwd_block_start[trace.ev_forward[arg]])
            for i in np.flatnonzero(event.state != IterationEvent.MASKED):
                known[block_start + int(i)] = int(event.tokens[i])
    return out


def coverage(trace: Trace, policy: str, budget: str, capture_slots: int, windows: list[int],
             expert_bytes: int) -> list[dict]:
    """One replay; a result per prediction (recent:W for each window, block, both, token, token+recent)."""
    mgr = replay_manager(trace, policy, budget, mapped_rows=mapped_rows(True), capture_slots=capture_slots)
    widest = max(windows)
    # the token predictions need the tokens, which traces recorded before them lack
    has_tokens = trace.ev_token is not None and "mask_token_id" in trace.header["model"]
    names = [f"recent:{w}" for w in windows] + ["block", "both"] + (["token", "token+recent"] if has_tokens else [])
    tokens = row_tokens(trace) if has_tokens else None
    mask = int(trace.header["model"]["mask_token_id"]) if has_tokens else None
    prior: dict[tuple[int, int], set] = {}  # (layer, token id) -> the experts rows with that input used (earlier runs)
    added = [0]                             # the runs added to the prior so far (trace order)
    last_rows: dict[int, dict] = {}         # layer -> position -> its input token at the layer's last mapped forward
    counts = {name: {"named": 0, "fetched": 0, "wasted": 0} for name in names}
    totals = {"misses": 0, "layer_iterations": 0, "misses_masked": 0, "misses_new_token": 0, "misses_unchanged": 0}
    history: dict[int, deque] = {}          # layer -> the experts of its last iterations, newest last
    first_of_block: dict[int, set] = {}     # layer -> the experts of the last block's first iteration
    current = {"forward": -1, "block_start": None, "request": None, "first": False}
    iterations = set()

    def before_mapped(run: int, layer: int, ids) -> None:
        forward = int(trace.run_forward[run])
        if forward != current["forward"]:
            info = trace.forward_info(forward)
            request = int(trace.fwd_request[forward])
            if request != current["request"]:
                history.clear()
                first_of_block.clear()
            current.update(forward=forward, request=request, first=info.block_start != current["block_start"],
                           block_start=info.block_start)
            iterations.add(forward)
        resident = mgr.cache.resident(layer).keys()
        need = set(ids.reshape(-1).tolist())
        if has_tokens:
            for i in range(added[0], run):  # the runs before this one into the token prior (never this forward's)
                rows, done = tokens[int(trace.run_forward[i])], trace.run_ids(i)
                for tok, experts in zip(rows.tolist(), done.tolist()):
                    if tok != mask:
                        prior.setdefault((int(trace.run_layer[i]), tok), set()).update(experts)
            added[0] = max(added[0], run)
            rows, start = tokens[forward], int(trace.fwd_start[forward])
            before = last_rows.get(layer, {})
            changed_rows = [r for r, tok in enumerate(rows.tolist())
                            if tok != mask and before.get(start + r, tok) != tok]
            last_rows[layer] = dict(enumerate(rows.tolist(), start))
        misses = need - resident
        past = history.setdefault(layer, deque(maxlen=widest))
        named = {}
        for w in windows:
            named[f"recent:{w}"] = set().union(*list(past)[-w:]) if past else set()
        named["block"] = first_of_block.get(layer, set()) if current["first"] else set()
        named["both"] = named[f"recent:{widest}"] | named["block"]
        if has_tokens:
            named["token"] = set().union(*(prior.get((layer, int(rows[r])), set()) for r in changed_rows))
            named["token+recent"] = named["token"] | named[f"recent:{widest}"]
        for name, experts in named.items():
            fetch = experts - resident
            c = counts[name]
            c["named"] += len(misses & fetch)
            c["fetched"] += len(fetch)
            c["wasted"] += len(fetch - need)
        totals["misses"] += len(misses)
        if has_tokens:
            # which rows use the misses: masked rows, rows whose token is new, rows unchanged (prompt, decoded earlier)
            kinds = {"masked": rows == mask, "new_token": np.isin(np.arange(len(rows)), changed_rows)}
            kinds["unchanged"] = ~(kinds["masked"] | kinds["new_token"])
            for kind, sel in kinds.items():
                totals[f"misses_{kind}"] += len(misses & set(ids[sel].reshape(-1).tolist()))
        totals["layer_iterations"] += 1
        past.append(need)
        if current["first"]:
            first_of_block[layer] = need

    mgr.replay(before_mapped)
    n_iter = max(len(iterations), 1)
    gb = expert_bytes / 1e9 / n_iter
    out = []
    for name in names:
        c = counts[name]
        out.append({"policy": policy, "budget": budget, "capture_slots": capture_slots, "prediction": name,
                    "iterations": len(iterations), "misses_per_iteration": totals["misses"] / n_iter,
                    "miss_gb_per_iteration": totals["misses"] * gb,
                    **({f"misses_used_by_{k}_rows": totals[f"misses_{k}"] / max(totals["misses"], 1)
                        for k in ("masked", "new_token", "unchanged")} if has_tokens else {}),
                    "named_fraction": c["named"] / max(totals["misses"], 1),
                    "fetched_per_iteration": c["fetched"] / n_iter, "fetched_gb_per_iteration": c["fetched"] * gb,
                    "wasted_fraction": c["wasted"] / max(c["fetched"], 1)})
    return out


def rows(trace: Trace, policy: str, budget: str, opts) -> list[dict]:
    return coverage(trace, policy, budget, opts.capture_slots, opts.windows, opts.expert_bytes)
