"""bench/ scripts as modules, for the tests of the benchmarks and of what builds on them. bench/ is not
a package and its transport.py would shadow ours on `sys.path`, so each script is loaded from its
file, once, under the name the benchmarks give it too (`swarmd_bench_<stem>`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(filename: str) -> ModuleType:
    """bench/`filename` as the module `swarmd_bench_<stem>` (the one already loaded, if any)."""
    name = f"swarmd_bench_{Path(filename).stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
