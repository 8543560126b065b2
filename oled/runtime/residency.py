"""The host-side decisions of the expert manager, with no tensors: events to the policy, slot tables, statistics.

Per MoE layer the expert manager hands the policy one LayerEvent (the routing per token, the demand, the resident
set, the forward's layout) and applies its LayerDecision: which misses are loaded and which computed on the CPU,
the waves of loads that fit the layer's slots, the evictions in the policy's order, what is prefetched for the next
layer; and it records the layer's statistics. All of that lives here, so that the live manager (which also copies
and computes) and the trace replayer (`oled bench --replay`, no weights, no GPU) run the very same code and get the
same hits, loads, evictions and CPU pairs from the same routing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..policies.base import Policy
from ..policies.contract import ForwardInfo, LayerDecision, LayerEvent, PolicyContext, increasing_ids
from .cpu_share import cpu_share_experts, cpu_share_table
from .expert_cache import ExpertCache
from .planner import split_misses
from .stats import LayerRecord, RunStats


@dataclass
class LayerStep:
    """One MoE layer's decisions in one forward."""
    layer: int
    demand: dict[int, int]      # expert -> tokens routed to it
    hits: list[int]             # needed experts resident when the layer runs
    decision: LayerDecision     # the misses: loaded (decision.load) or computed on the CPU (decision.cpu)
    rec: LayerRecord
    resident: frozenset[int]    # the layer's residents when its event was made (Residency.residents)


@dataclass
class Wave:
    """Experts one grouped computation can serve: `experts` (hits plus `loads`) fit the layer's slots together."""
    loads: list[int]            # experts to copy now, into `slots`
    slots: list[int]
    experts: set[int]


class Residency:
    def __init__(self, cache: ExpertCache, policy: Policy, stats: RunStats, *, num_experts: int, top_k: int,
                 expert_bytes: int, costs=None, mapped_rows: int = 0, capture_slots: int = 0,
                 cpu_share: bool = False):
        """mapped_rows: with mapped misses, the pairs a block of the fused kernels holds (their BLOCK_M), a mapped
        blob being read once per such block of its pairs; 0: mapped misses off. capture_slots: with mapped misses,
        the slots of a layer (free ones, then its next victims) a mapped forward may capture its misses into (at most
        half the layer's slots; 0: none, every miss a mapped forward keeps is copied after it; none either for a
        policy that never loads, Policy.loads_misses: it would pay the capture's kernel logic and capture nothing).
        cpu_share: with mapped misses, a policy that computes misses on the CPU (Policy.uses_cpu) and a cost model,
        a mapped forward's layers give part of their misses to the CPU (runtime/cpu_share.py)."""
        self.cache, self.policy, self.stats = cache, policy, stats
        self.top_k, self.mapped_rows = top_k, mapped_rows
        self.capture_slots = min(capture_slots, cache.capacity // 2) if mapped_rows and policy.loads_misses else 0
        # layer -> the slots the mapped forward under way may capture into, each with the expert it holds (None: free)
        self.armed: dict[int, list[tuple[int, int | None]]] = {}
        self._victims: dict[int, list[int]] = {}  # layer -> its last decision's eviction order
        # layer -> (the cache's version of its slot table, its residents as a frozenset and as increasing ids), made
        # again only once the version moves: most layers of most forwards load nothing, so rebuilding them per
        # event would be wasted host work
        self._residents: dict[int, tuple[int, frozenset[int], np.ndarray]] = {}
        self.layers = cache.layers
        self.layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        self.expert_bytes, self.num_experts = expert_bytes, num_experts
        self.forward: ForwardInfo | None = None
        # layer -> expert -> the record of the load (or prefetch) that brought it in, until a hit uses it or its slot
        # is given up (LayerRecord.loads_used)
        self.unused_loads: dict[int, dict[int, LayerRecord]] = {layer: {} for layer in self.layers}
        # with a CPU share: for m misses of a mapped layer, how many the CPU computes (the kernels read it too); none
        # where every expert stays resident (nothing is ever mapped: 0.13 s of start-up saved at 256 experts)
        self.cpu_share_table = (cpu_share_table(costs.mapped_reads(), num_experts)
                                if cpu_share and mapped_rows and policy.uses_cpu and costs is not None
                                and not self.all_resident else None)
        self.costs, self.cpu_scale = costs, 1.0      # the measured cost model; the scale its CPU terms plan with
        policy.setup(PolicyContext(layers=self.layers, num_experts=num_experts, capacity=cache.capacity,
                                   top_k=top_k, expert_bytes=expert_bytes, costs=costs, planner=split_misses))
        if policy.static_full and cache.capacity < num_experts:
            raise ValueError(f"policy {policy.name!r} needs every expert resident: use --expert-budget 1.0")

    @property
    def holds_everything(self) -> bool:
        """The budget holds every expert: all are placed at the start (whatever the policy), so no layer can miss."""
        return self.cache.capacity >= self.num_experts

    @property
    def all_resident(self) -> bool:
        """Every expert resident for good (a static policy, or a budget that holds them all): the forward needs no
        host step (the all-resident path), and each layer's statistics are recorded after it (record_resident)."""
        return self.policy.static_full or self.holds_everything

    def place_initial(self) -> list[tuple[int, list[int], list[int]]]:
        """Insert the policy's initial placement (every expert when the budget holds them all); returns (layer,
        experts, slots) for the caller to fill."""
        placed = []
        for layer in self.layers:
            experts = (list(range(self.num_experts)) if self.holds_everything
                       else self.policy.initial_placement(layer)[: self.cache.capacity])
            placed.append((layer, experts, [self.cache.insert(layer, e) for e in experts]))
        return placed

    def residents(self, layer: int) -> tuple[frozenset[int], np.ndarray]:
        """The layer's resident experts, as a frozenset and as increasing ids (read-only): LayerEvent.resident and
        resident_ids, made again only when the cache's version of the layer's slot table has moved."""
        version = self.cache.version[layer]
        view = self._residents.get(layer)
        if view is None or view[0] != version:
            resident = frozenset(self.cache.resident(layer))
            ids = increasing_ids(resident)
            ids.flags.writeable = False           # shared by the events of the layer until its slots change
            view = self._residents[layer] = (version, resident, ids)
        return view[1], view[2]

    # --------------------------------------------------------------------------------------------- per forward
    def begin_forward(self, info: ForwardInfo, cpu_scale: float = 1.0) -> None:
        """A forward starts; the policy plans it on the cost model with its CPU terms times cpu_scale (the engine's
        correction from the CPU jobs it has seen, runtime/cpu_feedback.py; a replay passes the recorded one)."""
        self.forward = info
        self.cpu_scale = cpu_scale
        if self.costs is not None:
            self.policy.plan_on(self.costs.with_cpu_scale(cpu_scale))
        self.stats.begin_forward(info.kind)
        self.policy.on_forward(info)

    def begin_resident_forward(self, info: ForwardInfo) -> None:
        """A forward on the all-resident path starts: its statistics only. The policy is told nothing, of this
        forward or of its layers (record_resident): with every expert resident for good it has nothing to decide,
        and its bookkeeping would only take host time (docs/decisions.md: all-resident-silent)."""
        self.forward = info
        self.stats.begin_forward(info.kind)

    # --------------------------------------------------------------------------------------------- per layer
    def begin_layer(self, layer: int, ids: np.ndarray, weights: np.ndarray,
                    predicted: np.ndarray | None = None, misses_served: bool = False) -> LayerStep:
        """ids, weights: the layer's routing [T, k]; predicted: the next layer's predicted ids (policies that want
        predictions); misses_served: the layer's misses were computed already (the mapped path). Hands the policy
        the layer's event, checks its decision, records the statistics."""
        counts = np.bincount(ids.reshape(-1), minlength=self.num_experts)
        experts = counts.nonzero()[0]                                         # increasing ids
        demand = dict(zip(experts.tolist(), counts[experts].tolist()))
        resident, resident_ids = self.residents(layer)
        misses = [e for e in demand if e not in resident]
        hits = [e for e in demand if e in resident] if misses else list(demand)
        forward = self.forward or ForwardInfo(kind=self.stats.kind, start=0, tokens=len(ids), block_start=0,
                                              block_length=len(ids))   # a layer run outside the decoding loop
        event = LayerEvent(layer=layer, forward=forward, ids=ids, weights=weights, demand=demand,
                           resident=resident, hits=hits, misses=misses, misses_served=misses_served,
                           resident_ids=resident_ids,
                           demand_ids=experts)
        if predicted is not None and (nxt := self.next_layer(layer)) is not None:
            p_experts, p_counts = np.unique(predicted, return_counts=True)
            event.predicted = dict(zip(p_experts.tolist(), p_counts.tolist()))
            event.next_layer, event.next_resident = nxt, self.residents(nxt)[0]
        decision = self.policy.decide(event)
        served = decision.load + decision.cpu
        if served != misses and sorted(served) != sorted(misses):     # (misses are distinct experts)
            raise RuntimeError(f"policy {self.policy.name!r}: a decision must split exactly the misses {misses} "
                               f"into load and cpu, got load={decision.load} cpu={decision.cpu}")
        rec = self.stats.layer(layer)
        unused = self.unused_loads[layer]
        if unused:                                       # resident and needed: hits on loads not yet used
            small, large = (unused, demand) if len(unused) < len(demand) else (demand, unused)
            for e in [e for e in small if e in large]:
                unused.pop(e).loads_used += 1
        rec.pairs, rec.experts, rec.expert_tokens = int(ids.size), len(demand), demand
        rec.experts_hit = len(hits)
        rec.pairs_hit = rec.pairs - sum(map(demand.__getitem__, misses))     # (most layers have no miss)
        rec.experts_cpu = len(decision.cpu)
        rec.pairs_cpu = sum(map(demand.__getitem__, decision.cpu))
        return LayerStep(layer, demand, hits, decision, rec, resident)

    def waves(self, step: LayerStep, resident_already: list[int] = ()):
        """Yield the layer's waves: hits plus as many loads as the layer's slots hold; more loads than slots run in
        further waves. The slots of a wave's loads are taken (evicting in the decision's order) before it is
        yielded. resident_already: misses made resident without a copy (captured), held like the hits and not
        loaded."""
        layer, rec = step.layer, step.rec
        protected = set(step.hits).union(resident_already)
        queue = [e for e in step.decision.load if e not in protected]
        while True:
            room = self.cache.capacity - len(protected)
            loads, queue = queue[:room], queue[room:]
            protected.update(loads)           # the wave's experts, none of them evicted for its loads
            slots = self._insert(layer, loads, protected, step.decision.evict, rec)
            rec.bytes_h2d += len(loads) * self.expert_bytes
            rec.loads += len(loads)
            yield Wave(loads, slots, protected)
            if not queue:
                break
            protected = set()

    def next_layer(self, layer: int) -> int | None:
        pos = self.layer_pos[layer] + 1
        return self.layers[pos] if pos < len(self.layers) else None

    def prefetch(self, step: LayerStep) -> tuple[int | None, list[int], list[int]]:
        """The decision's speculative loads for the next layer; returns (layer, experts, slots) to fill. Counted in
        the record of the layer that issues them."""
        nxt = self.next_layer(step.layer)
        if nxt is None or not step.decision.prefetch:
            return nxt, [], []
        resident = self.cache.resident(nxt)
        wanted = [e for e in step.decision.prefetch if e not in resident][: self.cache.capacity]
        slots = self._insert(nxt, wanted, set(wanted), step.decision.prefetch_evict, step.rec)
        step.rec.bytes_h2d += len(wanted) * self.expert_bytes
        step.rec.prefetches += len(wanted)
        return nxt, wanted, slots

    # ------------------------------------------------------------------------------------- mapped misses
    def takes_mapped_path(self, info: ForwardInfo) -> bool:
        """With mapped misses (and a budget that does not hold every expert: that is the all-resident path), a
        denoising iteration reads its misses from host memory, unless its experts average
        more than one block of pairs (the kernels read a mapped blob once per block of its pairs). A prefill or
        cache fill touches most experts and loads most of its misses anyway: it copies them once, on the host
        round trip (docs/decisions.md: prefill-round-trip), where the misses a policy sends to the CPU are read from
        host memory instead (cpu_on_host)."""
        return (self.mapped_rows > 0 and not self.all_resident and info.kind == "iteration"
                and info.tokens * self.top_k <= self.num_experts * self.mapped_rows)

    def arm_capture(self, mapped: bool, layers: list[int] | None = None) -> dict[int, list[int]]:
        """As a forward begins: on the mapped path with capture_slots, each layer's slots the kernels may write its
        misses into: its free slots (in the order the cache hands them out), then the slots of the experts its last
        decision would evict first, up to capture_slots. The kernels skip a slot that a pair of the forward reads
        and give the i-th miss by expert id the i-th slot left (oled/kernels/moe_align_kernel.py); decide_mapped
        applies the same rule. {} otherwise. `layers`: arm only these, whose slots no decision changes before the
        next forward (a mapped forward arms each layer for the next once that layer's decision is made, while the
        GPU runs the layers after it: ExpertManager._decide_mapped); the others keep what they were armed with.
        None: every layer, afresh. Returns layer -> slots, for the layers armed."""
        if layers is None:
            self.armed = {}
            layers = self.layers
        if not (mapped and self.capture_slots):
            return {}
        R = self.capture_slots
        out = {}
        for layer in layers:
            armed: list[tuple[int, int | None]] = [(slot, None) for slot in self.cache.free[layer][-R:][::-1]]
            resident = self.cache.resident(layer)
            for e in self._victims.get(layer, ()):
                if len(armed) >= R:
                    break
                if e in resident:
                    armed.append((resident[e], e))
            self.armed[layer] = armed
            out[layer] = [slot for slot, _ in armed]
        return out

    def mapped_cpu_share(self, layer: int, ids: np.ndarray) -> list[int]:
        """The misses of a mapped layer with routing ids that the CPU computes (none without a CPU share): the
        kernels' rule on the layer's slot table as the forward began (cpu_share.cpu_share_experts). Call it before
        the layer's decide_mapped, which changes the table."""
        if self.cpu_share_table is None:
            return []
        flat = ids.reshape(-1)
        missing = flat[self.cache.table[self.layer_pos[layer], flat] < 0]
        if not missing.size:
            return []
        return cpu_share_experts(np.unique(missing).tolist(), self.cpu_share_table, len(np.unique(flat)),
                                 self.cache.capacity)

    def decide_mapped(self, layer: int, ids: np.ndarray, weights: np.ndarray,
                      cpu_share: list[int] | None = None) -> Wave:
        """A layer that ran on the mapped path: every miss was computed already, from host memory by the GPU or,
        with a CPU share, on the CPU (cpu_share: mapped_cpu_share's answer, made before; None: made here), so the
        policy's decision (LayerEvent.misses_served) says what to load for later forwards. Returns the loads that fit beside
        the layer's hits (one wave), their slots taken; the caller copies them. With capture, the misses the kernels
        wrote into armed slots (never the CPU's) are resident already, in place of the victims those slots held (no
        copy): they are not loaded again."""
        if cpu_share is None:
            cpu_share = self.mapped_cpu_share(layer, ids)
        step = self.begin_layer(layer, ids, weights, misses_served=True)
        misses = step.decision.load + step.decision.cpu
        if misses:
            on_cpu = set(cpu_share)
            if on_cpu:          # the GPU's misses load first: the CPU's are those the slots cannot keep
                load = step.decision.load
                step.decision.load = [e for e in load if e not in on_cpu] + [e for e in load if e in on_cpu]
            self._record_mapped(step, [e for e in misses if e not in on_cpu], cpu_share)
            captured = self._take_captured(step, on_cpu) if self.capture_slots else []
            first = next(self.waves(step, captured))
        else:               # most layers of a denoising iteration: nothing mapped, captured or loaded
            first = Wave([], [], set(step.hits))
        if self.capture_slots:
            self._victims[layer] = list(step.decision.evict)
        self.end_layer(step)
        return first

    def _take_captured(self, step: LayerStep, on_cpu: set[int] = frozenset()) -> list[int]:
        """The misses the kernels wrote into the layer's armed slots (the kernels' rule: a slot is skipped if an
        expert of this layer's demand holds it; the i-th miss by id the GPU read takes the i-th slot left; the CPU's
        share, on_cpu, is never captured), made resident in place of the victims those slots held."""
        layer = step.layer
        usable = [(slot, owner) for slot, owner in self.armed.get(layer, []) if step.demand.get(owner, 0) == 0]
        captured = sorted(e for e in step.decision.load + step.decision.cpu if e not in on_cpu)[: len(usable)]
        for e, (slot, owner) in zip(captured, usable):
            if owner is not None:
                self.cache.evict(layer, owner)
                self.unused_loads[layer].pop(owner, None)
            self.cache.insert_at(layer, e, slot)
        step.rec.experts_captured = len(captured)
        return captured

    def cpu_on_host(self, step: LayerStep) -> list[int]:
        """The host round trip with mapped misses: the misses the decision sends to the CPU, which the first wave
        reads from host memory instead (recorded as mapped; none with mapped misses off)."""
        if not self.mapped_rows or not step.decision.cpu:
            return []
        self._record_mapped(step, step.decision.cpu)
        return list(step.decision.cpu)

    def _record_mapped(self, step: LayerStep, experts: list[int], on_cpu: list[int] = ()) -> None:
        """Misses the GPU computed from host memory (a blob is read once per block of its pairs) and those the CPU
        computed inside the forward (a CPU share)."""
        rec = step.rec
        rec.experts_mapped, rec.pairs_mapped = len(experts), sum(step.demand[e] for e in experts)
        rec.bytes_mapped = sum(-(-step.demand[e] // self.mapped_rows) for e in experts) * self.expert_bytes
        rec.experts_cpu, rec.pairs_cpu = len(on_cpu), sum(step.demand[e] for e in on_cpu)

    def end_layer(self, step: LayerStep) -> None:
        resident_after = self.cache.resident(step.layer)
        step.rec.resident = len(resident_after)
        view = self._residents.get(step.layer)
        if view is not None and view[1] is step.resident \
                and view[0] == self.cache.version[step.layer]:      # no slot changed since the event (most layers)
            step.rec.resident_used = len(step.hits)
        else:
            step.rec.resident_used = len(step.demand.keys() & resident_after.keys())

    def record_resident(self, layer: int, ids: np.ndarray) -> None:
        """A layer that ran on the all-resident path (all_resident), once its forward ended: its statistics (every
        pair a hit). No policy is asked anything: every expert stays resident for good, so no decision could load or
        evict (the statistics equal those of an event whose decision has nothing to do), and a policy's layer event
        would cost host time for nothing."""
        experts, counts = np.unique(ids.reshape(-1), return_counts=True)
        rec = self.stats.layer(layer)
        rec.pairs = rec.pairs_hit = int(ids.size)
        rec.experts = rec.experts_hit = rec.resident_used = len(experts)
        rec.resident = self.cache.capacity
        rec.expert_tokens = dict(zip(experts.tolist(), counts.tolist()))

    # ------------------------------------------------------------------------------------------------ slots
    def _insert(self, layer: int, experts: list[int], protected: set[int], evict_order: list[int],
                rec: LayerRecord) -> list[int]:
        """Copy-loads `experts` into the layer's slots (evicting in `evict_order`), counted as loads of `rec`."""
        slots = []
        unused = self.unused_loads[layer]
        order = None                       # the policy's order is only evaluated when a slot must be freed
        for e in experts:
            if not self.cache.has_free_slot(layer):
                order = iter(evict_order) if order is None else order
                resident = self.cache.resident(layer)
                victim = next((v for v in order if v in resident and v not in protected), None)
                if victim is None:
                    raise RuntimeError(f"policy {self.policy.name!r}: no expert of layer {layer} to evict for "
                                       f"{e} (eviction order {evict_order}, protected {sorted(protected)})")
                self.cache.evict(layer, victim)
                unused.pop(victim, None)
            slots.append(self.cache.insert(layer, e))
            unused[e] = rec
        return slots
