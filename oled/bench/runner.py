"""`oled bench`: every policy x budget x workload side by side, in one process (docs/DESIGN.md, Benchmarking rules).

BenchConfig carries the grid and the EngineConfig every run's engine is built from. The model and the expert store
are loaded once; each (policy, budget) gets a fresh expert manager (live.py). `--replay TRACE` runs the same grid on a
recorded trace instead (replay_grid.py); `--routing TRACE` runs the live grid with the trace's routing and commits.
The bound rows of either: bound_rows.py; the result files and the rows' bookkeeping: grid.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import EngineConfig
from ..decoding.params import DecodeParams
from ..policies.spec import PolicySpec
from .grid import Grid
from .live import LiveRuns
from .replay_grid import run_replay
from .report import render

__all__ = ["Bench", "BenchConfig", "PolicySpec", "parse_list", "run_bench"]


def parse_list(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


@dataclass
class BenchConfig:
    policies: list[str] = field(default_factory=lambda: ["full", "lru"])
    budgets: list[str] = field(default_factory=lambda: ["1.0", "0.6", "0.4", "0.25"])
    workloads: list[str] = field(default_factory=lambda: ["code"])
    out: str = "oled-bench"
    # the engine of every live run (its policy and budget are each run's); its tide_tau and popularity are the
    # defaults of a tide or a fiddler without options (popularity: else calibrated on the workload, or the trace's)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # decoding and protocol
    decode: DecodeParams = field(default_factory=DecodeParams)
    prompts: int | None = None           # use at most this many prompts of each workload
    repeats: int = 3
    warmup: int = 1                      # warm-up prompts per run (excluded)
    breakdown: str | None = None         # POLICY@BUDGET whose per-iteration breakdown is plotted
    profile_all: bool = False            # profiled pass for every run (sections in every line)
    profile: bool = True                 # False: no profiled pass at all
    replay: str | None = None            # a trace file: replay instead of running the model
    routing: str | None = None           # a trace file: run the model with the trace's routing and commits
    cost_model: str | None = None        # replay: cost model (JSON or a grid's results) for cooperative policies and bounds
    progress: bool = True
    render: bool = True                  # write report.md and plots at the end
    bound: bool = True                   # add `belady` (the retention bound) at every budget


class Bench(Grid):
    def run(self) -> list[dict]:
        self.open_outputs()
        if self.cfg.replay:
            run_replay(self)
        else:
            LiveRuns(self).run()
        if self.cfg.render and self.rows:
            render(self.out)
        return self.rows


def run_bench(cfg: BenchConfig) -> list[dict]:
    return Bench(cfg).run()
