"""Loading a benchmark script of `benchmarks/` as a module, for tests of its parts."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str, name: str):
    """`benchmarks/<script>` imported as the module `name`."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod
