"""Per-layer, per-forward expert statistics (docs/DESIGN.md, Statistics and Metrics), kept as plain Python records."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np

# per-record wall times: differ between runs, absent from a trace replay
TIMINGS = ("cpu_s", "cpu_path_s", "cpu_s_model")
COUNTERS = ("pairs", "pairs_hit", "pairs_cpu", "experts", "experts_hit", "experts_cpu", "loads", "prefetches",
            "bytes_h2d", "resident", "resident_used", "pairs_mapped", "experts_mapped", "bytes_mapped",
            "experts_captured", "loads_used")


@dataclass
class LayerRecord:
    forward: int
    kind: str                 # "prefill", "iteration" or "cache_fill"
    layer: int
    pairs: int = 0            # token-expert pairs routed
    pairs_hit: int = 0        # served by experts already resident when the layer ran
    pairs_cpu: int = 0        # computed on the CPU
    experts: int = 0          # unique experts needed
    experts_hit: int = 0
    experts_cpu: int = 0
    loads: int = 0            # demand loads (H2D copies of needed experts)
    prefetches: int = 0       # speculative loads issued at this layer (for a later layer)
    bytes_h2d: int = 0
    resident: int = 0         # resident experts of this layer after its loads
    resident_used: int = 0    # of those, used by at least one token in this forward
    cpu_s: float = 0.0        # time of this layer's CPU expert jobs, measured inside the kernel call
    cpu_path_s: float = 0.0   # the same jobs' time from their submission to their result (the wake-up included)
    cpu_s_model: float = 0.0  # the same jobs' time as the runtime's cost model predicted it (0: no cost model)
    pairs_mapped: int = 0     # computed by the GPU from the expert's blob in host memory (mapped misses)
    experts_mapped: int = 0
    bytes_mapped: int = 0     # read over PCIe by those computations (a blob once per block of pairs)
    experts_captured: int = 0  # of those, written into an armed slot as they were read: resident with no copy
    loads_used: int = 0       # of this layer's loads and prefetches, those a later layer found resident and needed
                              # (a hit) before their slot was given up (counted here, in the loading record)
    expert_tokens: dict = field(default_factory=dict)   # expert -> tokens (for popularity / traces)


class RunStats:
    def __init__(self):
        self.records: list[LayerRecord] = []
        self.forward = -1
        self.kind = "iteration"

    def begin_forward(self, kind: str) -> None:
        self.forward += 1
        self.kind = kind

    def layer(self, layer: int) -> LayerRecord:
        rec = LayerRecord(self.forward, self.kind, layer)
        self.records.append(rec)
        return rec

    def reset(self) -> None:
        self.__init__()

    def popularity(self) -> dict[int, dict[int, int]]:
        """layer -> expert -> tokens routed over the run (the calibration data of static placements)."""
        pop: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for r in self.records:
            for e, n in r.expert_tokens.items():
                pop[r.layer][e] += n
        return {layer: dict(d) for layer, d in pop.items()}

    def aggregate(self, kinds=("iteration",)) -> "Aggregate":
        """The sums behind summary(): small, and addable across requests (LLM.stats keeps these, not records)."""
        rows = [r for r in self.records if r.kind in kinds]
        util = [r.resident_used / r.resident for r in rows if r.resident]
        return Aggregate(counters={c: sum(getattr(r, c) for r in rows) for c in COUNTERS},
                         forwards=len({r.forward for r in rows}), layers=frozenset(r.layer for r in rows),
                         utilization_sum=float(np.sum(util)) if util else 0.0, utilization_n=len(util),
                         cpu_s=sum(r.cpu_s for r in rows), cpu_path_s=sum(r.cpu_path_s for r in rows),
                         cpu_s_model=sum(r.cpu_s_model for r in rows))

    def summary(self, kinds=("iteration",)) -> dict:
        return self.aggregate(kinds).summary()

    def to_rows(self) -> list[dict]:
        return [asdict(r) for r in self.records]


@dataclass(frozen=True)
class Aggregate:
    """Sums of a set of layer records: enough for every ratio of summary(), and closed under addition."""
    counters: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    forwards: int = 0
    layers: frozenset = frozenset()
    utilization_sum: float = 0.0      # sum over records with residents of resident_used / resident
    utilization_n: int = 0
    cpu_s: float = 0.0
    cpu_path_s: float = 0.0
    cpu_s_model: float = 0.0

    def __add__(self, other: "Aggregate") -> "Aggregate":
        return Aggregate({c: self.counters[c] + other.counters[c] for c in COUNTERS}, self.forwards + other.forwards,
                         self.layers | other.layers, self.utilization_sum + other.utilization_sum,
                         self.utilization_n + other.utilization_n, self.cpu_s + other.cpu_s,
                         self.cpu_path_s + other.cpu_path_s, self.cpu_s_model + other.cpu_s_model)

    def summary(self) -> dict:
        """Hit rates, traffic and CPU work per forward; {} when there is nothing to summarise."""
        if not self.forwards:
            return {}
        tot, forwards = dict(self.counters), self.forwards
        return {
            "forwards": forwards,
            "hit_rate_tokens": tot["pairs_hit"] / max(tot["pairs"], 1),
            "hit_rate_experts": tot["experts_hit"] / max(tot["experts"], 1),
            "cache_utilization": self.utilization_sum / self.utilization_n if self.utilization_n else 0.0,
            "hits_per_loaded_expert": tot["pairs_hit"] / max(tot["loads"] + tot["prefetches"], 1),
            "used_before_evicted": (tot["loads_used"] / (tot["loads"] + tot["prefetches"])
                                    if tot["loads"] + tot["prefetches"] else None),
            "misses_per_iteration": (tot["experts"] - tot["experts_hit"]) / forwards,
            "h2d_gb_per_iteration": tot["bytes_h2d"] / 1e9 / forwards,
            "cpu_pairs_per_iteration": tot["pairs_cpu"] / forwards,
            "mapped_pairs_per_iteration": tot["pairs_mapped"] / forwards,
            "mapped_gb_per_iteration": tot["bytes_mapped"] / 1e9 / forwards,
            "captured_experts_per_iteration": tot["experts_captured"] / forwards,
            "loads_per_iteration": tot["loads"] / forwards,
            "unique_experts_per_layer_iteration": tot["experts"] / (forwards * len(self.layers)),
            "cpu_ms_per_iteration": self.cpu_s * 1e3 / forwards,
            "cpu_cost_model_ratio": (self.cpu_s_model / self.cpu_s if self.cpu_s > 0 and self.cpu_s_model > 0
                                     else None),
            "cpu_path_cost_model_ratio": (self.cpu_s_model / self.cpu_path_s
                                          if self.cpu_path_s > 0 and self.cpu_s_model > 0 else None),
            "totals": tot,
        }
