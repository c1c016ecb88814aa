"""bench/netns.py (two network namespaces joined by a tbf-shaped veth pair) and bench/wan_link.py
(peers behind delayed, shaped links) for the tests that build on them, and the marks such a test
module carries: selected by `-m netns`, skipped without root, saying why. bench/ is not a package
and its transport.py would shadow ours on `sys.path`, so each module is loaded from its file, once,
under the name the benchmarks give it too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, filename: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


netns = _load("swarmd_bench_netns", "netns.py")
wan_link = _load("swarmd_bench_wan_link", "wan_link.py")
#: The `pytestmark` of a module whose tests need a shaped link.
MARKS = [
    pytest.mark.netns,
    pytest.mark.skipif(netns.unavailable_reason() is not None, reason=str(netns.unavailable_reason())),
]
#: The `pytestmark` of a module whose tests need a delayed link (bench/wan_link.py).
WAN_MARKS = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(wan_link.unavailable_reason() is not None, reason=str(wan_link.unavailable_reason())),
]
