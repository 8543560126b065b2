"""A learned retention score: how soon a layer will use an expert again, from its routing history, fitted on traces.

Belady keeps the experts whose next use is soonest. The next use is unknown, but a layer's recent routing says much
about it: RetentionFeatures keeps, per (layer, expert), the tokens routed to it in the layer's last HISTORY runs,
whether it was used in each, the runs since its last use, its uses in the request, whether the current and the
previous block's first run used it, and the run's step in its block. RetentionModel scores an expert by a linear
model of those features, fitted by least squares on recorded traces (`fit`, `oled trace --fit-retention`) to
exp(-d / SCALE), d being the runs of its layer until its next use: higher is sooner. Plain NumPy, no tensors.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources

import numpy as np

from ..bounds import Demand
from .base import read_json

HISTORY = 4              # the layer's last runs whose tokens and use are features
RECENCY_CAP = 20         # runs since the last use, capped (never used: the cap)
STEP_CAP = 10            # the run's step in its block, capped
SCALE = 4.0              # the target's decay, in runs of the layer: exp(-d / SCALE)
DISTANCE_CAP = 50        # next uses farther than this count as this far
FEATURES = (("bias",) + tuple(f"tokens_{j}" for j in range(HISTORY)) + tuple(f"used_{j}" for j in range(HISTORY))
            + ("recency", "request_uses", "block_first", "previous_block_first", "block_step", "used_now_step"))


class RetentionFeatures:
    """The features of every (layer, expert), updated run by run of each layer."""

    def __init__(self, layers: list[int], num_experts: int):
        self.num_experts = num_experts
        self.layers = {layer: _LayerHistory(num_experts) for layer in layers}

    def reset(self) -> None:
        """A new request: nothing of the last one carries over."""
        for h in self.layers.values():
            h.reset()

    def observe(self, layer: int, experts: np.ndarray, tokens: np.ndarray, block) -> None:
        """A run of `layer` routed tokens[i] rows to experts[i] (distinct ids); block: any key of the block being
        decoded (a run of a new key starts the layer's block)."""
        self.layers[layer].observe(experts, tokens, block)

    def matrix(self, layer: int) -> np.ndarray:
        """[num_experts, len(FEATURES)] float64: the layer's features after its last run."""
        return self.layers[layer].matrix()


class _LayerHistory:
    def __init__(self, num_experts: int):
        self.E = num_experts
        self.reset()

    def reset(self) -> None:
        E = self.E
        self.tokens = np.zeros((HISTORY, E))            # [j, e]: tokens routed j runs ago
        self.last = np.full(E, -RECENCY_CAP, dtype=np.int64)
        self.runs = 0
        self.uses = np.zeros(E)
        self.block_first = np.zeros(E)
        self.previous_first = np.zeros(E)
        self.block = None
        self.step = 0

    def observe(self, experts, tokens, block) -> None:
        now = np.zeros(self.E)
        now[experts] = tokens
        if block != self.block:
            self.block, self.step = block, 0
            self.previous_first, self.block_first = self.block_first, (now > 0).astype(np.float64)
        else:
            self.step += 1
        self.tokens = np.roll(self.tokens, 1, axis=0)
        self.tokens[0] = now
        self.runs += 1
        self.last[experts] = self.runs
        self.uses[experts] += 1

    def matrix(self) -> np.ndarray:
        step = min(self.step, STEP_CAP) / STEP_CAP
        used = self.tokens > 0
        recency = np.minimum(self.runs - self.last, RECENCY_CAP) / RECENCY_CAP
        return np.column_stack((np.ones(self.E), *np.log1p(self.tokens), *used, recency, np.log1p(self.uses),
                                self.block_first, self.previous_first, np.full(self.E, step), used[0] * step))


@dataclass
class RetentionModel:
    weights: list[float]
    features: list[str] = field(default_factory=lambda: list(FEATURES))
    provenance: dict = field(default_factory=dict)

    def __post_init__(self):
        if list(self.features) != list(FEATURES) or len(self.weights) != len(FEATURES):
            raise ValueError(f"malformed retention model: features {self.features} with {len(self.weights)} "
                             f"weights, expected {list(FEATURES)}")
        self.w = np.asarray(self.weights, dtype=np.float64)
        if not np.isfinite(self.w).all():
            raise ValueError("malformed retention model: non-finite weights")

    def score(self, features: np.ndarray) -> np.ndarray:
        """Higher: used again sooner."""
        return features @ self.w

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def load(cls, source=None) -> "RetentionModel":
        """A model file (JSON from `oled trace --fit-retention`), a dict, a model, or None: the one shipped with the
        package."""
        if isinstance(source, RetentionModel):
            return source
        if source is None:
            data = json.loads(resources.files("oled").joinpath("policies/data/retention_model.json").read_text())
        elif isinstance(source, dict):
            data = source
        else:
            data = read_json(source, "retention model")
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"malformed retention model ({e})") from None


def trace_samples(trace) -> tuple[np.ndarray, np.ndarray]:
    """Every (layer run, expert) of a trace as (features [N, F], runs of the layer until the expert's next use [N],
    inf where never), the features as RetentionFeatures has them after the run."""
    demand = Demand.from_trace(trace)
    features = RetentionFeatures(demand.layers, int(trace.header["model"]["num_experts"]))
    X, position, runs_of = [], [], {}        # position: each run's index among its layer's runs
    request = None
    for r, run in enumerate(demand.runs):
        f = int(trace.run_forward[r])
        if int(trace.fwd_request[f]) != request:
            request = int(trace.fwd_request[f])
            features.reset()
        features.observe(run.layer, run.experts, run.tokens, (request, int(trace.fwd_block_start[f])))
        X.append(features.matrix(run.layer))
        position.append(runs_of.get(run.layer, 0))
        runs_of[run.layer] = position[-1] + 1
    D = [None] * len(demand.runs)
    ahead: dict[int, np.ndarray] = {}      # layer -> per expert, the position of its next run using it
    for r in range(len(demand.runs) - 1, -1, -1):
        run = demand.runs[r]
        nxt = ahead.setdefault(run.layer, np.full(features.num_experts, np.inf))
        D[r] = nxt - position[r]
        nxt[run.experts] = position[r]
    return np.concatenate(X), np.concatenate(D)


def fit(traces, names: list[str] | None = None) -> RetentionModel:
    """Least squares of exp(-min(d, DISTANCE_CAP) / SCALE) on the features, over every (layer run, expert) of the
    traces."""
    samples = [trace_samples(t) for t in traces]
    X = np.concatenate([s[0] for s in samples])
    D = np.concatenate([s[1] for s in samples])
    y = np.exp(-np.minimum(D, DISTANCE_CAP) / SCALE)
    w = np.linalg.lstsq(X, y, rcond=None)[0]
    return RetentionModel(weights=[float(v) for v in w],
                          provenance={"traces": names or [], "samples": int(len(y)),
                                      "target": f"exp(-min(d, {DISTANCE_CAP}) / {SCALE}), d: runs of the layer "
                                                f"until the next use"})
