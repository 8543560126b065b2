"""The policy interface: events in, one decision out. A policy is plain Python bookkeeping; it never touches tensors.

The runtime tells a policy what happened, in order, and applies what it returns:
  on_request_start()          a new request starts
  on_forward(info)            a forward starts: its kind and which rows are which canvas positions (ForwardInfo)
  decide(event) -> decision   per MoE layer of the forward: the routing per token (ids and weights [T, k]), the
                              demand, the resident set -> which misses to load, which to compute on the CPU, the
                              eviction order, optional prefetch for the next layer (LayerDecision)
  on_iteration(event)         after a denoising iteration: each block position's state and confidence
The live expert manager and the trace replayer produce the very same events, so a replay reaches the same decisions.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..runtime.cost_model import CostModel
from ..runtime.planner import PlanInputs, split_misses

MISS_MODES = ("load", "cooperative")   # what a caching policy does with a miss: load it, or let the planner split


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
    mapped: bool = False             # the misses were computed already, from host memory (the manager's mapped
                                     # path): a decision's loads fill slots for later forwards, its CPU misses are
                                     # just not loaded
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
        stable). One lexsort over the ids the residency keeps instead of sorted() over Python tuples (~20 us for a
        layer's hundred residents, paid by every layer of a mapped forward with capture, which keeps its order)."""
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


@dataclass
class PolicyContext:
    layers: list[int]          # MoE layer indices
    num_experts: int
    capacity: int              # slots per layer
    top_k: int
    expert_bytes: int
    costs: CostModel | None = None   # measured miss-service costs (given when the policy computes on the CPU)


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


class Policy:
    name = "base"
    uses_cpu = False            # the policy may compute misses on the CPU
    static_full = False         # every expert resident, nothing to decide: the manager skips host round trips
    wants_prediction = False    # events carry the next layer's predicted routing
    loads_misses = True         # a decision may load; False (a static placement): the mapped path arms no capture
    needs_future = False        # replay only: the policy is given the trace's future demand (belady)

    def setup(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.iteration = 0
        self.block_step = 0

    def initial_placement(self, layer: int) -> list[int]:
        """Experts to make resident before the first forward (static placements)."""
        return []

    def on_request_start(self) -> None:
        """A new request starts (per-request state resets; learned residency may stay)."""
        self.iteration = 0
        self.block_step = 0

    def on_forward(self, info: ForwardInfo) -> None:
        """A forward starts."""

    def decide(self, event: LayerEvent) -> LayerDecision:
        raise NotImplementedError

    def on_iteration(self, event: IterationEvent) -> None:
        self.iteration = event.iteration + 1
        self.block_step = 0 if event.block_done else event.step + 1

    # ------------------------------------------------------------------------------------- shared helpers
    def cooperative_split(self, event: LayerEvent, credit: dict[int, float] | None = None,
                          evict_loss: list[float] | None = None, waves: bool = False) -> tuple[list[int], list[int]]:
        """Split the misses between loading and the CPU with the planner on the measured costs. Loads fill the free
        slots first (a free slot is never left empty for a miss sent to the CPU). They are capped at the slots not
        holding a hit, so the layer runs in one wave, unless `waves`: then any miss may load, in further waves that
        reuse the slots of experts already computed (the misses of a layer that needs more experts than it has
        slots need not all go to the CPU). evict_loss[i] is the predicted value lost by the i-th eviction a load
        beyond the free slots causes."""
        if event.mapped:        # nothing to split: every miss was served; load them (most rows first) as lru does
            return sorted(event.misses, key=lambda e: (-event.demand[e], e)), []
        if self.ctx.costs is None:
            raise RuntimeError(f"policy {self.name!r}: cooperative miss handling needs the measured cost model")
        hits = event.hits
        misses = {e: event.demand[e] for e in event.misses}
        free = self.ctx.capacity - len(event.resident)
        inputs = PlanInputs(tokens=misses, rows=len(event.ids),
                            free_slots=free, max_loads=None if waves else self.ctx.capacity - len(hits),
                            credit=credit or {},
                            evict_loss=evict_loss or [])
        return split_misses(inputs, self.ctx.costs)


def read_json(path, what: str, hint: str = ""):
    """A policy's data file (JSON), with one clear line for a missing or malformed file."""
    from ..textfile import read_text

    path = Path(path)
    try:
        return json.loads(read_text(path, f"{what} file"))
    except FileNotFoundError:
        raise ValueError(f"{what} file {str(path)!r} not found{hint}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} file {str(path)!r} is not JSON ({e})") from None
