"""Decoding parameters of one request (the diffusion knobs plus sampling)."""
from __future__ import annotations

import math
from dataclasses import dataclass


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class DecodeParams:
    gen_length: int = 256
    block_length: int | None = None      # None: the model's default (config or architecture table)
    steps: int | None = None             # iterations per block of the minimum-tokens schedule; None: block_length
    minimal_topk: int = 1                # LLaDA2: steps is capped at gen_length // minimal_topk (official default 1)
    threshold: float | None = 0.95       # commit every masked position above it; None: fixed-steps rule only
    rule: str = "threshold"              # "threshold" (LLaDA2) or "low_confidence" (LLaDA fixed steps)
    temperature: float = 0.0             # 0: greedy
    seed: int | None = None
    cache: str = "prefix"                # "none", "prefix" or "dual"
    stop: tuple[str, ...] = ()

    def validate(self, max_positions: int | None = None) -> None:
        # counts: positive integers (a float steps would reach the schedule; a huge one is capped there)
        for name in ("gen_length", "block_length", "steps", "minimal_topk"):
            value = getattr(self, name)
            if value is None and name in ("block_length", "steps"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        # numbers: NaN fails every comparison, so each range is written as what a valid value satisfies
        if self.threshold is not None and not (_is_number(self.threshold) and 0.0 <= self.threshold <= 1.0):
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold!r}")
        if not (_is_number(self.temperature) and 0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.rule not in ("threshold", "low_confidence"):
            raise ValueError(f"rule must be 'threshold' or 'low_confidence', got {self.rule!r}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:      # what torch.Generator.manual_seed takes
            raise ValueError(f"seed must be between -2**63 and 2**64 - 1, got {self.seed}")
        if self.cache not in ("none", "prefix", "dual"):
            raise ValueError(f"cache must be 'none', 'prefix' or 'dual', got {self.cache!r}")
