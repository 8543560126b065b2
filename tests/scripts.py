"""The benchmark scripts loaded as modules for tests: benchmarks/ holds scripts, not a package; maintained tools at
its top level, one-question probes under benchmarks/probes/."""
from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_script(name: str):
    """benchmarks/NAME.py, or benchmarks/probes/NAME.py, as a module (its main() is not run)."""
    file = f"{name.removesuffix('.py')}.py"
    path = next((p for p in (BENCHMARKS / file, BENCHMARKS / "probes" / file) if p.is_file()), BENCHMARKS / file)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
