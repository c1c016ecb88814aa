"""One regression test per bug the fuzzers found and that was fixed at its root (`FIXED_BUGS`).

The general fuzz tests would find such an input again only by luck, so each recorded input is fed
to its target every run and must end in the target's documented error (or parse): a finding here
means the fix was undone.
"""

from __future__ import annotations

import pytest

from fuzz_oracle import check
from fuzz_targets import FIXED_BUGS, TARGETS


@pytest.mark.parametrize("name,target,reproducer", FIXED_BUGS, ids=[bug[0] for bug in FIXED_BUGS])
def test_fixed_bug_stays_fixed(name: str, target: str, reproducer: bytes) -> None:
    """The recorded input now ends in the target's documented error (or parses), never a finding."""
    finding, _, _ = check(TARGETS[target], reproducer)
    assert finding is None, f"{name} is back: {finding.kind}:\n{finding.detail}"
