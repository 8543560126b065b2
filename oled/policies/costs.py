"""The cost table of miss service: what loading an expert and computing one on the CPU take on this machine.

Plain numbers (no torch): the planner and the policies read it, a trace carries it, and runtime/cost_model.py
measures it (H2D bandwidth with the store's own pinned blobs, CPU time per expert from the CPU kernel's
calibration, the slowdowns while both read host memory).
"""
from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property

import numpy as np

from ..textfile import read_results


def _per_token_count(table: dict[int, float], keys: list[int], tokens: int) -> float:
    """A per-expert time for `tokens` tokens from a table measured at a few token counts: linear between them,
    proportional beyond the largest."""
    if tokens <= keys[0]:
        return table[keys[0]]
    if tokens >= keys[-1]:
        return table[keys[-1]] * tokens / keys[-1]
    i = bisect.bisect_left(keys, tokens)
    lo, hi = keys[i - 1], keys[i]
    f = (tokens - lo) / (hi - lo)
    return table[lo] * (1 - f) + table[hi] * f


@dataclass
class CostModel:
    expert_bytes: int
    h2d_gbps: float                       # expert blob copies into cache slots, GB/s
    cpu_seconds: dict[int, float]         # tokens per expert -> seconds per expert (CPU kernel, cold weights)
    cpu_call_seconds: float = 0.0         # fixed time of one kernel call (starting and joining its threads)
    cpu_slowdown_with_copies: float = 1.0  # CPU time factor while H2D copies run concurrently
    gpu_seconds: dict[int, float] = field(default_factory=dict)   # tokens per expert -> grouped-GEMM seconds per
                                          # expert over the slot pool (empty: not measured, counted as 0)
    copy_slowdown_with_cpu: float = 1.0   # H2D copy time factor while the CPU kernel runs (both read host DRAM)
    transfer_seconds: float = 0.0         # fixed time of a layer's activation round trip to the CPU path
    row_bytes: int = 0                    # bytes of one token's input sent to the host
    pair_bytes: int = 0                   # bytes of one (token, expert) output sent back
    mapped_seconds: float = 0.0           # GPU seconds a miss adds to the fused MoE kernels that read it from host
                                          # memory (one token, compute included; 0: not measured)
    source: str = "measured"

    def load_seconds(self, n_experts: int) -> float:
        return n_experts * self.expert_bytes / (self.h2d_gbps * 1e9)

    def cpu_expert_seconds(self, tokens: int) -> float:
        """Per-expert CPU time for `tokens` tokens, interpolated linearly between calibrated token counts."""
        memo = self._cpu_memo
        if tokens not in memo:        # the planner asks for every miss of every layer: a few token counts recur
            memo[tokens] = _per_token_count(self.cpu_seconds, self._cpu_counts, tokens)
        return memo[tokens]

    def gpu_expert_seconds(self, tokens: int) -> float:
        """Per-expert grouped-GEMM time on the device for `tokens` tokens (0 where it was not measured)."""
        if not self.gpu_seconds:
            return 0.0
        memo = self._gpu_memo
        if tokens not in memo:
            memo[tokens] = _per_token_count(self.gpu_seconds, self._gpu_counts, tokens)
        return memo[tokens]

    def cpu_expert_seconds_of(self, tokens: np.ndarray) -> np.ndarray:
        """cpu_expert_seconds of each token count (an int array): the very same values, from a lookup table."""
        return self._lookup(self.cpu_expert_seconds, tokens)

    def gpu_expert_seconds_of(self, tokens: np.ndarray) -> np.ndarray:
        """gpu_expert_seconds of each token count (an int array)."""
        return self._lookup(self.gpu_expert_seconds, tokens)

    def _lookup(self, per_tokens, tokens: np.ndarray) -> np.ndarray:
        """per_tokens of each count from a table of per_tokens(0 .. n-1), grown when a larger count is asked for: the
        planner asks for every miss of every layer, a few small counts that recur."""
        tokens = np.asarray(tokens, dtype=np.int64)
        top = int(tokens.max()) if tokens.size else 0
        table = self._tables.get(per_tokens.__name__)
        if table is None or top >= table.size:
            table = self._tables[per_tokens.__name__] = np.array([per_tokens(t) for t in range(max(2 * top + 1, 64))])
        return table[tokens]

    def cpu_transfer_seconds(self, rows: int, pairs: int) -> float:
        """The activations' round trip of a layer with CPU work: its input rows to the host, the pairs' outputs
        back, over the measured copy bandwidth, plus the measured fixed time."""
        return self.transfer_seconds + (rows * self.row_bytes + pairs * self.pair_bytes) / (self.h2d_gbps * 1e9)

    @cached_property
    def _cpu_counts(self) -> list[int]:     # sorted once: the planner asks for every miss of every layer
        return sorted(self.cpu_seconds)

    @cached_property
    def _gpu_counts(self) -> list[int]:
        return sorted(self.gpu_seconds)

    @cached_property
    def _tables(self) -> dict[str, np.ndarray]:
        return {}

    @cached_property
    def _cpu_memo(self) -> dict[int, float]:
        return {}

    @cached_property
    def _gpu_memo(self) -> dict[int, float]:
        return {}

    def mapped_reads(self) -> "CostModel":
        """This model as the mapped path's GPU side sees a miss: read inside the MoE kernels (mapped_seconds an
        expert, its compute included) rather than copied, then computed; itself where mapped_seconds was not
        measured. A copy pays a fixed cost per blob that a kernel's read does not, so planning a mapped layer's CPU
        share on the copy rate would overrate the CPU for small experts."""
        if self.mapped_seconds <= 0:
            return self
        return replace(self, h2d_gbps=self.expert_bytes / self.mapped_seconds / 1e9, gpu_seconds={},
                       source=f"{self.source}, misses read mapped")

    def cpu_jobs_seconds(self, tokens) -> float:
        """One kernel call over experts with these token counts (0 for none)."""
        tokens = list(tokens)
        return self.cpu_call_seconds + sum(map(self.cpu_expert_seconds, tokens)) if tokens else 0.0

    def with_cpu_scale(self, scale: float) -> "CostModel":
        """This model with its CPU kernel terms (per expert and per call) times `scale`: what the planner uses once
        the engine has seen its CPU jobs run slower or faster than measured at start-up (runtime/cpu_feedback.py).
        One model per scale is made, then kept."""
        if scale == 1.0:
            return self
        scaled = self._scaled
        if scale not in scaled:
            scaled[scale] = replace(self, cpu_seconds={t: s * scale for t, s in self.cpu_seconds.items()},
                                    cpu_call_seconds=self.cpu_call_seconds * scale,
                                    source=f"{self.source}, CPU x{scale:.3g} as observed")
        return scaled[scale]

    @cached_property
    def _scaled(self) -> dict[float, "CostModel"]:
        return {}

    def describe(self) -> str:
        cpu = ", ".join(f"{self.cpu_seconds[t] * 1e6:.0f}" for t in sorted(self.cpu_seconds))
        gpu = ", ".join(f"{self.gpu_seconds[t] * 1e6:.1f}" for t in sorted(self.gpu_seconds)) or "not measured"
        mapped = f"{self.mapped_seconds * 1e6:.1f} µs/expert" if self.mapped_seconds > 0 else "not measured"
        return (f"load {self.load_seconds(1) * 1e6:.0f} µs/expert ({self.h2d_gbps:.1f} GB/s), x"
                f"{self.copy_slowdown_with_cpu:.2f} beside CPU jobs; CPU {cpu} µs/expert at "
                f"{'/'.join(map(str, sorted(self.cpu_seconds)))} tokens + {self.cpu_call_seconds * 1e6:.0f} µs per "
                f"call + {self.transfer_seconds * 1e6:.0f} µs activation round trip, x"
                f"{self.cpu_slowdown_with_copies:.2f} while copying; GPU {gpu} µs/expert; mapped read {mapped} "
                f"({self.source})")

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("cpu_seconds", "gpu_seconds"):
            d[key] = {str(k): v for k, v in d[key].items()}   # JSON object keys
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """A cost model from to_dict(); models written before the GPU and transfer terms existed read with them at
        0 (a trace recorded then replays on the costs it was recorded with)."""
        try:
            d = dict(d)
            d.pop("gpu_seconds_per_expert", None)    # version 5's unmeasured GPU term (always 0)
            model = cls(**dict(d, cpu_seconds={int(k): float(v) for k, v in d["cpu_seconds"].items()},
                               gpu_seconds={int(k): float(v) for k, v in d.get("gpu_seconds", {}).items()}))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed cost model ({type(e).__name__}: {e})") from None
        if not model.cpu_seconds:
            raise ValueError("malformed cost model: no CPU times")
        return model

    @classmethod
    def from_file(cls, path) -> "CostModel":
        """A cost model's JSON file, or an `oled bench` results.jsonl (gzipped if it ends in .gz) whose first line
        with a cost model gives it."""
        text = read_results(path)
        if not str(path).removesuffix(".gz").endswith(".jsonl"):
            try:
                return cls.from_json(text)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
        model = next((row["cost_model"] for row in map(json.loads, text.splitlines()) if row.get("cost_model")), None)
        if model is None:
            raise ValueError(f"{path}: no line carries a cost model")
        return cls.from_dict(model)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed cost model: not JSON ({e})") from None
        return cls.from_dict(d)
