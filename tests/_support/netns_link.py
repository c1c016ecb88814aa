"""bench/netns.py (two network namespaces joined by a tbf-shaped veth pair) and bench/wan_link.py
(peers behind delayed, shaped links) for the tests that build on them, and the marks such a test
module carries: selected by `-m netns`, skipped without root, saying why. Both are loaded by
tests/_support/benchmod.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmod import load_bench

REPO = Path(__file__).resolve().parents[2]


netns = load_bench("netns.py")
wan_link = load_bench("wan_link.py")
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
