"""The expert budget: how many bytes of routed experts the GPU may hold, as a fraction or an absolute size."""
from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


ROUNDING = 1e-9      # relative slack for decimal fractions in binary floating point (0.29 * 100 = 28.999...)


class BudgetError(ValueError):
    """The budget cannot run the model (too small, too large, or unparsable)."""


@dataclass(frozen=True)
class ExpertBudget:
    slots_per_layer: int
    num_layers: int
    expert_bytes: int
    total_expert_bytes: int

    @property
    def slots(self) -> int:
        return self.slots_per_layer * self.num_layers

    @property
    def bytes(self) -> int:
        return self.slots * self.expert_bytes

    @property
    def fraction(self) -> float:
        return self.bytes / self.total_expert_bytes

    def describe(self, place: str = "on the GPU") -> str:
        """One line; `place` says where the slots live ("on the GPU", or the cache's device on a CPU run)."""
        return (f"{self.bytes / 2**30:.2f} GiB of routed experts {place} ({self.fraction:.0%}: "
                f"{self.slots_per_layer} of {self.total_expert_bytes // self.expert_bytes // self.num_layers} "
                f"experts per layer)")


def parse_spec(spec: str | float) -> tuple[float, str]:
    """(value, unit) of a budget, checked as far as it can be without a model: '%' is a percentage (at most 100),
    '' a fraction (at most 1), else a byte unit. `oled bench` checks its whole list this way before any run."""
    text = str(spec).strip().lower().replace(" ", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)(%|[kmgt]i?b|b)?", text)
    if not m:
        raise BudgetError(f"expert budget {spec!r}: expected a fraction (0.4), a percentage (40%) or a size (12GiB)")
    value, unit = float(m.group(1)), m.group(2) or ""
    if unit == "" and value > 1.0:
        raise BudgetError(f"expert budget {spec!r}: a bare number is a fraction of the routed-expert bytes and "
                          f"must be at most 1; write a size with its unit (12GiB) or a percentage (40%)")
    if unit == "%" and value > 100.0:
        raise BudgetError(f"expert budget {spec!r}: a percentage of the routed-expert bytes must be at most 100%")
    return value, unit


def parse_budget(spec: str | float, *, num_layers: int, num_experts: int, expert_bytes: int) -> ExpertBudget:
    """'0.4' or '40%' of all routed-expert bytes, or an absolute size ('12GiB', '500MB'); 1.0 = all resident.

    The slots are split evenly over the MoE layers (each layer has its own slot table). A budget that leaves a
    layer without a slot is refused, and so is one above 100 % (a bare 2.0, 150 % or a size beyond the experts'
    bytes alike): it would hide a typo behind "everything resident".
    """
    total = num_layers * num_experts * expert_bytes
    value, unit = parse_spec(spec)
    nbytes = value / 100 * total if unit == "%" else value * total if unit == "" else value * _UNITS[unit]
    if nbytes > total * (1 + ROUNDING):
        raise BudgetError(f"expert budget {spec!r} ({nbytes / 2**30:.3g} GiB) is more than all the routed experts "
                          f"take ({total / 2**30:.3g} GiB); 1.0 (or 100%) keeps every expert resident")
    per_layer = min(num_experts, int(nbytes / (expert_bytes * num_layers) + ROUNDING))   # 0.29*100 -> 29, not 28
    if per_layer < 1:
        need = num_layers * expert_bytes
        raise BudgetError(f"expert budget {spec!r} ({nbytes / 2**20:.1f} MiB) is too small to run: at least one "
                          f"expert slot per MoE layer is needed ({need / 2**20:.1f} MiB, "
                          f"{need / total:.2%} of the routed experts)")
    return ExpertBudget(per_layer, num_layers, expert_bytes, total)
