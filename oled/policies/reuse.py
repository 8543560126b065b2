"""Reuse prediction for the OLED policy: which experts the next iteration of a block will use again.

Adjacent iterations of a block run the same positions, and a position's routing repeats when its input does:
  - a position decoded earlier keeps its token, so its routing mostly repeats (its context still moves a little);
  - a position still masked keeps the mask token, but the confident ones are about to be committed, after which
    their input (and routing) changes: the lower the confidence, the likelier the routing repeats;
  - a position committed now arrives next iteration with a new token: its routing mostly changes;
  - at a block boundary the next block starts all-mask, routed like the masked positions of the blocks before it.
`ReuseCalibration` holds those probabilities, measured on traces (`calibrate`): P(a (position, expert) pair
routed at iteration t is routed again at t+1 | the position's state and confidence after t), and how much of a
block's first-iteration mask routing the previous block's first-iteration mask routing covers. `ReusePredictor`
turns them into a score per (layer, expert) after every iteration:

    score(l, e) <- decay * score(l, e) + sum over rows routed to e of p(row) * g(row, e)

(g = 1, or the routing weight), plus at a block boundary the first-iteration mask routing of the block just done.
Plain NumPy bookkeeping: one vectorised update per iteration for all layers, no tensors.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources

import numpy as np

from .base import ForwardInfo, IterationEvent, read_json

DECODED, MASKED, COMMITTED = IterationEvent.DECODED, IterationEvent.MASKED, IterationEvent.COMMITTED
CONFIDENCE_EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_EDGES = np.array(CONFIDENCE_EDGES)
WEIGHTINGS = ("count", "weight")


@dataclass
class ReuseCalibration:
    decoded: float                   # P(pair reused next iteration | position decoded earlier)
    committed: float                 # ... | committed at this iteration
    masked: list[float]              # ... | still masked, per confidence bin (CONFIDENCE_EDGES)
    masked_first: float              # ... | masked, at a block's first iteration (no confidence known yet)
    mask_prior: float                # recall of a block's first-iteration mask pairs by the previous block's
    pairs: dict = field(default_factory=dict)   # pairs each figure was measured on
    provenance: dict = field(default_factory=dict)

    def masked_p(self, confidence: np.ndarray) -> np.ndarray:
        """P(reuse) of masked positions by their confidence's bin: below the first edge (-inf: positions not
        masked) or NaN in the first bin, above the last (+inf) in the last."""
        conf = np.asarray(confidence, dtype=np.float64)
        bins = np.searchsorted(_EDGES, conf, side="right") - 1
        bins[np.isnan(conf)] = 0
        return np.asarray(self.masked)[np.clip(bins, 0, len(self.masked) - 1)]

    def position_p(self, state: np.ndarray, confidence: np.ndarray, masked: np.ndarray | None = None) -> np.ndarray:
        """P(reuse next iteration) of each block position's pairs from its state after this iteration; masked:
        masked_p(confidence) if the caller has it."""
        masked = self.masked_p(confidence) if masked is None else masked
        return np.where(state == DECODED, self.decoded, np.where(state == COMMITTED, self.committed, masked))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def load(cls, source=None) -> "ReuseCalibration":
        """A calibration file (JSON from `oled trace --calibrate-reuse`), a dict, or None: the one shipped with the
        package (measured on the bundled model's traces)."""
        if isinstance(source, ReuseCalibration):
            return source
        if source is None:
            text = resources.files("oled").joinpath("policies/data/reuse_calibration.json").read_text()
            data = json.loads(text)
        elif isinstance(source, dict):
            data = source
        else:
            data = read_json(source, "reuse calibration")
        try:
            cal = cls(**data)
        except TypeError as e:
            raise ValueError(f"malformed reuse calibration ({e})") from None
        if len(cal.masked) != len(CONFIDENCE_EDGES) - 1:
            raise ValueError(f"malformed reuse calibration: {len(cal.masked)} confidence bins, expected "
                             f"{len(CONFIDENCE_EDGES) - 1}")
        return cal


class ReusePredictor:
    """Per-layer predicted-reuse scores, updated after each iteration from the routing of its forward."""

    def __init__(self, layers: list[int], num_experts: int, calibration: ReuseCalibration, decay: float = 0.0,
                 weighting: str = "count"):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.layers, self.num_experts = list(layers), num_experts
        self.pos = {layer: i for i, layer in enumerate(self.layers)}
        self.cal, self.decay, self.weighting = calibration, decay, weighting
        self.score = np.zeros((len(self.layers), num_experts))
        self.mask_routing = np.zeros((len(self.layers), num_experts))   # the block's first-iteration mask pairs
        self.forward: ForwardInfo | None = None
        self._block_rows = (np.zeros(0, np.int64), np.zeros(0, np.int64))   # no forward yet: no block rows
        self.routing: dict[int, tuple[np.ndarray, np.ndarray]] = {}      # layer -> (ids, weights) of this forward
        self.block_p = None     # per block position: P(reuse) of its pairs now, from the last iteration's states
        self._log_keep = None   # log(1 - current_p) of the current forward's rows: every layer of it asks

    def reset(self) -> None:
        """A new request: scores carry over (the experts stay resident), per-request positions do not."""
        self.block_p = None
        self.routing.clear()

    def on_forward(self, info: ForwardInfo) -> None:
        self.forward = info
        self._block_rows = info.block_rows()        # asked by every layer of the forward
        self._log_keep = None
        self.routing.clear()

    def observe(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> None:
        self.routing[layer] = (ids, weights)

    def row_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, block positions) of the current forward's rows that belong to the block being decoded."""
        return self._block_rows

    def current_p(self, rows: np.ndarray, positions: np.ndarray, n_rows: int) -> np.ndarray:
        """P(reuse next iteration) of each row of the current forward, from what is known before it ends: positions
        decoded (or committed) by the last iteration keep their token; masked ones are scored by their last
        confidence; at a block's first iteration, the calibrated first-iteration figure. Rows outside the block: 0."""
        p = np.zeros(n_rows)
        if self.block_p is None or len(self.block_p) != self.forward.block_length:
            p[rows] = self.cal.masked_first
        else:
            p[rows] = self.block_p[positions]
        return p

    def log_keep(self, n_rows: int) -> np.ndarray:
        """log(1 - current_p) of each row of the current forward (p capped below 1): the same for each of its
        layers, so made once per forward."""
        if self._log_keep is None or len(self._log_keep) != n_rows:
            rows, positions = self._block_rows
            self._log_keep = np.log1p(-np.minimum(self.current_p(rows, positions, n_rows), 1.0 - 1e-12))
        return self._log_keep

    def on_iteration(self, event: IterationEvent) -> None:
        """Fold this iteration's routing into the scores, weighted by each row's P(reuse next iteration)."""
        self._log_keep = None
        self.score *= self.decay
        masked_p = None
        if self.forward is not None and self.forward.kind == "iteration" and self.routing:
            rows, positions = self.row_positions()
            layers = [layer for layer in self.layers if layer in self.routing]
            n_rows = self.routing[layers[0]][0].shape[0]
            # (at a block's end its final tokens run once more, writing the cache with the next block's start: every
            # position is then decoded or committed, scored as such)
            masked_p = self.cal.masked_p(event.confidence)      # (block_p's too, below)
            p_pos = self.cal.position_p(event.state, event.confidence, masked_p)
            p = np.zeros(n_rows)
            p[rows] = p_pos[positions]
            self._add(layers, p, self.score)
            if event.step == 0:     # the mask routing of a block's first iteration predicts the next block's
                masked = np.zeros(n_rows)
                masked[rows] = (event.state[positions] != DECODED).astype(np.float64)
                self.mask_routing[:] = 0.0
                self._add(layers, masked, self.mask_routing)
        if event.block_done:
            self.score += self.cal.mask_prior * self.mask_routing
            self.block_p = None
        else:
            if masked_p is None:
                masked_p = self.cal.masked_p(event.confidence)
            self.block_p = np.where(event.state == MASKED, masked_p, self.cal.decoded)

    def _add(self, layers: list[int], p_rows: np.ndarray, into: np.ndarray) -> None:
        """into[layer, e] += sum over rows r routed to e of p_rows[r] * g(r, e), every layer in one update."""
        idx = np.stack([self.routing[layer][0] for layer in layers])             # [L, R, k]
        g = (np.stack([self.routing[layer][1] for layer in layers]) if self.weighting == "weight"
             else np.ones(idx.shape))
        flat = (np.array([self.pos[layer] for layer in layers])[:, None, None] * self.num_experts + idx).ravel()
        into.reshape(-1)[:] += np.bincount(flat, weights=(p_rows[None, :, None] * g).ravel(),
                                           minlength=into.size)

    def layer_scores(self, layer: int) -> np.ndarray:
        return self.score[self.pos[layer]]


def calibrate(traces) -> ReuseCalibration:
    """Measure the reuse probabilities on recorded traces (iteration forwards of the same request)."""
    edges = np.asarray(CONFIDENCE_EDGES)
    n_bins = len(edges) - 1
    hit = {"decoded": 0, "committed": 0, "first": 0, "mask_prior": 0}
    tot = dict.fromkeys(hit, 0)
    m_hit, m_tot = np.zeros(n_bins), np.zeros(n_bins)
    names = []
    for trace in traces:
        names.append(trace.header["model"]["name"])
        for prev, nxt, event in _iteration_pairs(trace):
            if event.block_done:      # the next forward starts the next block: only the mask-prior figure
                continue
            for layer_prev, layer_next in zip(prev["layers"], nxt["layers"]):
                ids_a, ids_b = layer_prev, layer_next
                for pos in range(len(event.state)):
                    ra, rb = prev["rows"].get(pos), nxt["rows"].get(pos)
                    if ra is None or rb is None:
                        continue
                    a, b = ids_a[ra], set(ids_b[rb].tolist())
                    reused = sum(int(e) in b for e in a)
                    state = event.state[pos]
                    if event.step == 0 and state != DECODED:
                        hit["first"] += reused
                        tot["first"] += len(a)
                    if state == DECODED:
                        hit["decoded"] += reused
                        tot["decoded"] += len(a)
                    elif state == COMMITTED:
                        hit["committed"] += reused
                        tot["committed"] += len(a)
                    else:
                        c = event.confidence[pos]
                        i = int(np.clip(np.searchsorted(edges, c, side="right") - 1, 0, n_bins - 1))
                        m_hit[i] += reused
                        m_tot[i] += len(a)
        for a, b in _first_iteration_pairs(trace):
            hit["mask_prior"] += len(a & b)
            tot["mask_prior"] += len(b)
    mean_masked = m_hit.sum() / max(m_tot.sum(), 1)
    masked = [float(m_hit[i] / m_tot[i]) if m_tot[i] else float(mean_masked) for i in range(n_bins)]
    rate = {k: hit[k] / tot[k] if tot[k] else 0.0 for k in hit}
    return ReuseCalibration(decoded=rate["decoded"], committed=rate["committed"], masked=masked,
                            masked_first=rate["first"], mask_prior=rate["mask_prior"],
                            pairs={**tot, "masked": [int(n) for n in m_tot]},
                            provenance={"traces": names, "method": "oled.policies.reuse.calibrate"})


def _forward_rows(trace, f: int) -> dict[int, int]:
    """Block position -> row of forward f."""
    info = trace.forward_info(f)
    rows, positions = info.block_rows()
    return dict(zip(positions.tolist(), rows.tolist()))


def _runs_by_forward(trace) -> dict[int, list[int]]:
    runs_of: dict[int, list[int]] = {}
    for i, f in enumerate(trace.run_forward.tolist()):
        runs_of.setdefault(f, []).append(i)
    return runs_of


def _iteration_pairs(trace):
    """(forward t, forward t+1, the event after t) for consecutive iteration forwards of one request, each forward
    as its rows by block position and its per-layer routing (ids [R, k]) in layer order."""
    runs_of = _runs_by_forward(trace)

    def describe(f):
        return {"rows": _forward_rows(trace, f), "layers": [trace.run_ids(i) for i in runs_of.get(f, [])]}

    events = list(range(len(trace.ev_forward)))
    iteration_kind = 1
    for j, k in zip(events, events[1:]):
        fa = int(trace.ev_forward[j])
        fb = int(trace.ev_forward[k])
        if trace.fwd_request[fa] != trace.fwd_request[fb] or trace.fwd_kind[fb] != iteration_kind:
            continue
        if any(trace.fwd_kind[g] == iteration_kind for g in range(fa + 1, fb)):
            continue
        yield describe(fa), describe(fb), trace.event(j)


def _first_iteration_pairs(trace):
    """Per layer, (mask pairs of block b's first iteration, of block b+1's) as expert sets, same request."""
    firsts = [(int(trace.ev_forward[j]), int(trace.fwd_request[trace.ev_forward[j]]))
              for j in range(len(trace.ev_forward)) if trace.ev_step[j] == 0]
    runs_of = _runs_by_forward(trace)
    for (fa, ra), (fb, rb) in zip(firsts, firsts[1:]):
        if ra != rb:
            continue
        rows_a, rows_b = list(_forward_rows(trace, fa).values()), list(_forward_rows(trace, fb).values())
        for ia, ib in zip(runs_of.get(fa, []), runs_of.get(fb, [])):
            yield (set(trace.run_ids(ia)[rows_a].reshape(-1).tolist()),
                   set(trace.run_ids(ib)[rows_b].reshape(-1).tolist()))
