"""The harness itself: seeds reach deep into each parser, and the oracle can fail.

A fuzz test that cannot fail proves nothing, so the oracle is checked against targets that crash,
hang, allocate too much or break an invariant on purpose, and against one that only raises its
documented error.
"""

from __future__ import annotations

import time

import pytest

from fuzz_oracle import HANG_S, InvariantBroken, KnownBug, Target, check, raised_in
from fuzz_targets import TARGETS


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_seeds_are_accepted_by_their_target(name: str) -> None:
    """Seeds come from the project's own encoders: none is a finding, none is skipped by the harness,
    and most decode without error, so mutations start from inputs past the parser's outer checks."""
    target = TARGETS[name]
    seeds = target.seeds()
    accepted = 0
    for seed in seeds:
        assert check(target, seed)[0] is None
        try:
            reached = target.run(seed)
        except target.expected:
            continue
        assert reached is not False, f"seed {seed.hex()} never reached the module under test"
        accepted += 1
    assert accepted >= len(seeds) / 2


def _target(run, expected=(ValueError,), bound=1 << 20, known=()) -> Target:
    return Target("probe", run, expected, lambda n: bound, lambda: [b""], known)


def test_documented_error_is_not_a_finding() -> None:
    def run(data):
        raise ValueError("bad input, properly refused")

    assert check(_target(run), b"x")[0] is None


def test_undocumented_exception_is_a_crash_with_its_traceback() -> None:
    def run(data):
        return {}[data]

    finding = check(_target(run), b"\x01")[0]
    assert finding.kind == "crash" and "KeyError" in finding.detail and finding.known is None


def test_known_bug_is_counted_but_named() -> None:
    def run(data):
        raise OverflowError("int too large")

    bug = KnownBug("probe-bug", __file__, raised_in(OverflowError, "test_fuzz_seeds_and_oracle"), b"", "probe")
    finding = check(_target(run, known=(bug,)), b"")[0]
    assert finding.kind == "crash" and finding.known == "probe-bug"


def test_slow_input_is_a_hang() -> None:
    def run(data):
        time.sleep(HANG_S + 0.1)

    assert check(_target(run), b"")[0].kind == "hang"


def test_allocation_past_the_bound_is_reported() -> None:
    def run(data):
        blob = bytearray(4 << 20)  # 4 MiB against a 1 MiB bound
        del blob

    finding = check(_target(run), b"")[0]
    assert finding.kind == "over_allocation" and "bound 1048576" in finding.detail


def test_broken_invariant_is_reported() -> None:
    def run(data):
        raise InvariantBroken("round trip changed the value")

    assert check(_target(run), b"")[0].kind == "invariant"
