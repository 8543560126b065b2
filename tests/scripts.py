"""The benchmark scripts loaded as modules for tests: benchmarks/ holds scripts, not a package."""
from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_script(name: str):
    """benchmarks/NAME.py as a module (its main() is not run)."""
    path = BENCHMARKS / f"{name.removesuffix('.py')}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
