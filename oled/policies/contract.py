"""The policy contract: what the runtime tells a policy and what a policy answers, with nothing behind it.

A forward starts (ForwardInfo); per MoE layer the runtime hands the policy a LayerEvent and applies its
LayerDecision (evicting in an EvictionOrder); after each denoising iteration the loop's IterationEvent. A policy is
set up once with a PolicyContext, whose planner splits misses between loads and the CPU on a cost table (PlanInputs
in, (load, cpu) out). This module imports no torch and nothing from the runtime: the live manager, the trace
replayer and the policies all depend on it, and it on nothing of theirs.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .costs import CostModel


@dataclass(frozen=True)
class ForwardInfo:
    """What a forward is: kind ("prefill", "iteration" or "cache_fill"), its rows (canvas positions start ..
    start + tokens - 1) and the block being decoded (canvas positions block_start .. block_start + block_length - 1).
    A block's first forward under the prefix cache also carries the previous block's final tokens (rows before the
    block), whose K/V it writes."""
    kind: str
    start: int
    tokens: int
    block_start: int
    block_length: int

    def block_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, block positions) of the rows that belong to the block being decoded."""
        positions = np.arange(self.start, self.start + self.tokens) - self.block_start
        rows = np.nonzero((positions >= 0) & (positions < self.block_length))[0]
        return rows, positions[rows]


@dataclass
class LayerEvent:
    """One MoE layer of one forward, as the runtime sees it before deciding anything."""
    layer: int
    forward: ForwardInfo
    ids: np.ndarray                  # [T, k] routed expert ids per row (token-major)
    weights: np.ndarray              # [T, k] routing weights per row (fp32)
    demand: dict[int, int]           # expert -> rows routed to it (experts in first-seen order of np.unique)
    resident: Set[int]               # experts resident in this layer's slots before the layer runs (not to be changed)
    predicted: dict[int, int] | None = None     # policies with wants_prediction: the next layer's predicted demand
    next_layer: int | None = None
    next_resident: Set[int] | None = None
    hits: list[int] = None           # needed experts resident (computed if not given), in demand order
    misses: list[int] = None         # needed experts not resident
    misses_served: bool = False      # the misses were computed already (read from host memory or on the CPU):
                                     # a decision's loads fill slots for later forwards, its CPU misses are just
                                     # not loaded
    resident_ids: np.ndarray = None  # `resident` as increasing ids (read-only), for vectorised eviction orders
    demand_ids: np.ndarray = None    # the demand's experts as increasing ids (read-only), for vectorised bookkeeping

    def __post_init__(self):
        if self.hits is None:
            self.hits = [e for e in self.demand if e in self.resident]
        if self.misses is None:
            self.misses = [e for e in self.demand if e not in self.resident]
        if self.resident_ids is None:
            self.resident_ids = increasing_ids(self.resident)
        if self.demand_ids is None:
            self.demand_ids = increasing_ids(self.demand)


def increasing_ids(experts) -> np.ndarray:
    """Expert ids as an increasing int64 array: `experts` itself if it is one (LayerEvent.resident_ids), else any
    sized iterable of distinct ids, sorted."""
    if isinstance(experts, np.ndarray):
        return experts
    ids = np.fromiter(experts, dtype=np.int64, count=len(experts))
    ids.sort()
    return ids


class EvictionOrder:
    """An eviction order computed only if a slot is needed (most layers evict nothing), then kept: `rank()` returns
    the experts as a list, first evicted first. The policy's state it reads must not change before the layer is
    done, which holds because a policy is only called again with the next event."""

    def __init__(self, rank: Callable[[], list[int]]):
        self._rank, self._order = rank, None

    def __iter__(self):
        if self._order is None:
            self._order = self._rank()
        return iter(self._order)

    @classmethod
    def by_keys(cls, experts, keys: Callable[[np.ndarray], tuple], extra: Iterable[int] = ()):
        """`experts` (increasing ids as LayerEvent.resident_ids, or any iterable of ids) and `extra` (experts not
        among them: the layer's misses), ordered by keys(cand): NumPy arrays of sort keys over the candidates'
        increasing ids `cand`, the most significant last (np.lexsort's order), ties by lower id (np.lexsort is
        stable). One lexsort over the ids the residency keeps instead of sorted() over Python tuples: paid by
        every layer of a mapped forward with capture, which keeps its order."""
        def rank():
            cand = increasing_ids(experts)
            if extra:
                cand = np.sort(np.concatenate((cand, np.fromiter(extra, dtype=np.int64))))
            return cand[np.lexsort(keys(cand))].tolist()
        return cls(rank)


def member_mask(size: int, experts) -> np.ndarray:
    """A boolean array over expert ids 0 .. size - 1, True at `experts`: an int array of ids (any shape, repeats
    allowed: a layer's routed ids) or a sized iterable of ids. An eviction order's "is one of" key."""
    if not isinstance(experts, np.ndarray):
        experts = np.fromiter(experts, dtype=np.int64, count=len(experts))
    mask = np.zeros(size, dtype=bool)
    mask[experts] = True
    return mask


@dataclass
class LayerDecision:
    """What the runtime does for one layer. `load` + `cpu` must be exactly the misses. When a load needs a slot and
    none is free, the runtime evicts the first expert of `evict` (a list or an EvictionOrder) that is resident and
    not needed by the wave being served; experts missing from `evict` are never evicted. `prefetch` are experts of
    the next MoE layer copied ahead after this layer's own copies, evicting there in `prefetch_evict` order."""
    load: list[int] = field(default_factory=list)
    cpu: list[int] = field(default_factory=list)
    evict: Iterable[int] = ()
    prefetch: list[int] = field(default_factory=list)
    prefetch_evict: Iterable[int] = ()


@dataclass(frozen=True)
class PolicyContext:
    """What a policy is set up with; the runtime never changes it afterwards (the costs of each forward come with
    Policy.plan_on)."""
    layers: list[int]          # MoE layer indices
    num_experts: int
    capacity: int              # slots per layer
    top_k: int
    expert_bytes: int
    costs: CostModel | None = None       # measured miss-service costs (given when the policy computes on the CPU)
    planner: MissPlanner | None = None   # splits a layer's misses between loads and the CPU (runtime/planner.py)


@dataclass
class IterationEvent:
    """What the decoding loop tells the runtime after each denoising iteration (host data only)."""
    block: int                       # Block.index (decoding/procedure.py: counted from 0 or the prompt end)
    step: int                        # iteration within the block (0 = the block's first)
    iteration: int                   # global iteration counter of the request
    state: np.ndarray                # per block position: 0 decoded earlier, 1 still masked, 2 committed now
    confidence: np.ndarray           # per block position: confidence of the prediction (-inf where not masked)
    block_done: bool                 # the block has no mask left
    tokens: np.ndarray | None = None  # per block position: its token after the iteration (the mask id where masked)

    DECODED, MASKED, COMMITTED = 0, 1, 2


@dataclass
class PlanInputs:
    """One layer's misses as the planner sees them (runtime/planner.py: the objective and the search)."""
    tokens: dict[int, int]                  # miss expert -> tokens routed to it
    rows: int = 0                           # the layer's input rows (sent to the host when there is CPU work)
    free_slots: int = 0
    max_loads: int | None = None
    credit: dict[int, float] = field(default_factory=dict)
    evict_loss: list[float] = field(default_factory=list)   # per eviction, in the order they happen

    @property
    def min_loads(self) -> int:
        return min(max(self.free_slots, 0), len(self.tokens), self.load_cap)

    @property
    def load_cap(self) -> int:
        n = len(self.tokens)
        return n if self.max_loads is None else max(0, min(self.max_loads, n))


class MissPlanner(Protocol):
    """Splits a layer's misses: (experts to load, experts to compute on the CPU), the cheapest on `costs`."""

    def __call__(self, inputs: PlanInputs, costs: CostModel) -> tuple[list[int], list[int]]: ...
