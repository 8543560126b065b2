"""The benchmark workloads shipped as data files (NAME.jsonl, each with a provenance header).

The loader lives in oled.bench.workloads; these names are re-exported so `from oled.data import workloads` works.
"""
from ...bench.workloads import Prompt, Workload, available, load, load_prompts

__all__ = ["Prompt", "Workload", "available", "load", "load_prompts"]
