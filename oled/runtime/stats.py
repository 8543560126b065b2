"""Per-layer, per-forward expert statistics (DESIGN.md section 7), kept as plain Python records."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np

TIMINGS = ("cpu_s", "cpu_s_model")   # per-record wall times: differ between runs, absent from a trace replay
COUNTERS = ("pairs", "pairs_hit", "pairs_cpu", "experts", "experts_hit", "experts_cpu", "loads", "prefetches",
            "bytes_h2d", "resident", "resident_used")


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
    cpu_s_model: float = 0.0  # the same jobs' time as the runtime's cost model predicted it (0: no cost model)
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

    def summary(self, kinds=("iteration",)) -> dict:
        rows = [r for r in self.records if r.kind in kinds]
        if not rows:
            return {}
        tot = {c: sum(getattr(r, c) for r in rows) for c in COUNTERS}
        forwards = len({r.forward for r in rows})
        n_layers = len({r.layer for r in rows})
        util = [r.resident_used / r.resident for r in rows if r.resident]
        cpu_s, cpu_s_model = sum(r.cpu_s for r in rows), sum(r.cpu_s_model for r in rows)
        return {
            "forwards": forwards,
            "hit_rate_tokens": tot["pairs_hit"] / max(tot["pairs"], 1),
            "hit_rate_experts": tot["experts_hit"] / max(tot["experts"], 1),
            "cache_utilization": float(np.mean(util)) if util else 0.0,
            "hits_per_loaded_expert": tot["pairs_hit"] / max(tot["loads"] + tot["prefetches"], 1),
            "h2d_gb_per_iteration": tot["bytes_h2d"] / 1e9 / forwards,
            "cpu_pairs_per_iteration": tot["pairs_cpu"] / forwards,
            "loads_per_iteration": tot["loads"] / forwards,
            "unique_experts_per_layer_iteration": tot["experts"] / (forwards * n_layers),
            "cpu_ms_per_iteration": cpu_s * 1e3 / forwards,
            "cpu_cost_model_ratio": cpu_s_model / cpu_s if cpu_s > 0 and cpu_s_model > 0 else None,
            "totals": tot,
        }

    def to_rows(self) -> list[dict]:
        return [asdict(r) for r in self.records]
