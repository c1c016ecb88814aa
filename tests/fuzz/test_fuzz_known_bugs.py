"""One strict-xfail reproducer per bug the fuzzers found in someone else's module, and one
regression test per bug fixed since (`FIXED_BUGS`).

Each test feeds the exact recorded input to its target and asserts the oracle finds nothing. While
the bug stands the test fails (xfail); once the owner fixes it, the test passes and strict=True turns
that into a failure here, telling whoever fixed it to delete the KnownBug entry in fuzz_targets.py
(after which the general fuzz tests guard the fix).
"""

from __future__ import annotations

import pytest

from fuzz_oracle import check
from fuzz_targets import FIXED_BUGS, KNOWN_BUGS, TARGETS


def _target_of(bug):
    return next(t for t in TARGETS.values() if bug in t.known_bugs)


@pytest.mark.parametrize(
    "bug",
    [pytest.param(bug, id=bug.name, marks=pytest.mark.xfail(strict=True, reason=f"{bug.owner_file}: {bug.summary}"))
     for bug in KNOWN_BUGS],
)
def test_known_bug_reproducer_is_fixed(bug) -> None:
    finding, _, _ = check(_target_of(bug), bug.reproducer)
    assert finding is None, f"{finding.kind}:\n{finding.detail}"


@pytest.mark.parametrize("bug", KNOWN_BUGS, ids=lambda bug: bug.name)
def test_known_bug_reproducer_matches_only_its_own_signature(bug) -> None:
    """The tolerance in the general tests is exactly this bug: its reproducer is recognised as it,
    and the target's clean seeds are not."""
    target = _target_of(bug)
    finding, _, _ = check(target, bug.reproducer)
    if finding is None:
        pytest.skip(f"{bug.name} no longer reproduces: delete it from fuzz_targets.KNOWN_BUGS")
    assert finding.known == bug.name
    for seed in target.seeds():
        assert check(target, seed)[0] is None


@pytest.mark.parametrize("name,target,reproducer", FIXED_BUGS, ids=[bug[0] for bug in FIXED_BUGS])
def test_fixed_bug_stays_fixed(name: str, target: str, reproducer: bytes) -> None:
    """The recorded input now ends in the target's documented error (or parses), never a finding."""
    finding, _, _ = check(TARGETS[target], reproducer)
    assert finding is None, f"{name} is back: {finding.kind}:\n{finding.detail}"
