"""A benchmark script (``benchmarks/NAME.py``) loaded as a module, for the CPU dry runs of
the benchmark tests (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, module: str | None = None):
    """``benchmarks/<name>.py`` executed as a fresh module named ``module`` (default
    ``<name>_bench``): each call a new module, so a test's monkeypatching stays its own."""
    spec = importlib.util.spec_from_file_location(module or f"{name}_bench",
                                                  BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
