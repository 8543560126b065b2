"""The replay sub-reports of `oled trace --report TRACE` (one module each under oled/trace/): their flags, defaults
and the options they share. Each replays the trace's policies x budgets on the CPU and yields one JSON-able row per
cell (and per prediction, for --ahead), budgets outermost."""
from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass

from .format import Trace

OPTIONS = ("policies", "cost_model", "expert_mib", "windows", "burst_steps")   # the options a sub-report may use
WINDOWS = "1,2,4,8"     # --ahead: iterations looked back by recent:W
BURST_STEPS = 6         # --bursts: block steps shown one by one; later ones are grouped


@dataclass(frozen=True)
class SubReport:
    name: str                   # the flag: --NAME
    help: str
    module: str                 # oled.trace.MODULE, whose rows(trace, policy, budget, opts) -> list[dict]
    budgets: str                # default budgets
    policies: str | None        # default policies; None: no policy is chosen (the report replays belady itself)
    uses: tuple[str, ...]       # the OPTIONS it reads besides --budgets, --capture-slots and --first


SUBREPORTS = {s.name: s for s in (
    SubReport("coverage", "the misses a layer's recorded prediction names one layer ahead, and what it names in vain "
              "(oled/trace/prefetch_coverage.py)", "prefetch_coverage", "0.6,0.4,0.25", "oled,lru",
              ("policies", "cost_model")),
    SubReport("ahead", "the misses the routing history or a token prior names one iteration ahead "
              "(oled/trace/ahead_coverage.py)", "ahead_coverage", "0.6,0.4,0.25", "oled-retain",
              ("policies", "expert_mib", "windows")),
    SubReport("bursts", "the mapped path's bytes by block step (oled/trace/miss_bursts.py)", "miss_bursts", "0.4",
              "oled-retain,belady", ("policies", "cost_model", "expert_mib", "burst_steps")),
    SubReport("forced", "the misses no policy can avoid with the slots a layer gets, beside belady's "
              "(oled/trace/forced_misses.py)", "forced_misses", "0.6,0.4,0.25", None, ("expert_mib",)),
)}


@dataclass(frozen=True)
class ReportOptions:
    capture_slots: int
    costs: object = None        # a CostModel, or None: the trace's
    expert_bytes: int = 0       # the expert size bytes are counted at
    windows: tuple[int, ...] = tuple(int(w) for w in WINDOWS.split(","))
    steps: int = BURST_STEPS


def unused_options(sub: SubReport, given: dict) -> list[str]:
    """The OPTIONS given (not None) that `sub` does not read."""
    return [name for name in OPTIONS if given.get(name) is not None and name not in sub.uses]


def run_subreport(sub: SubReport, trace: Trace, budgets: list[str], policies: list[str] | None,
                  opts: ReportOptions) -> Iterator[dict]:
    """Every row of `sub` on `trace`: budgets outermost, then policies (the defaults where None)."""
    rows = importlib.import_module(f"{__package__}.{sub.module}").rows
    for budget in budgets:
        for policy in (policies or sub.policies.split(",")) if sub.policies else [None]:
            yield from rows(trace, policy, budget, opts)
