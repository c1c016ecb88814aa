"""The harness itself: seeds reach deep into each parser, and the oracle can fail.

A fuzz test that cannot fail proves nothing, so the oracle is checked against targets that crash,
hang, allocate too much or break an invariant on purpose, and against one that only raises its
documented error.
"""

from __future__ import annotations

import time

import pytest

import fuzz_oracle
from fuzz_oracle import InvariantBroken, Target, assert_clean, check
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


def _target(run, expected=(ValueError,), bound=1 << 20) -> Target:
    return Target("probe", run, expected, lambda n: bound, lambda: [b""])


def test_documented_error_is_not_a_finding() -> None:
    def run(data):
        raise ValueError("bad input, properly refused")

    assert check(_target(run), b"x")[0] is None


def test_undocumented_exception_is_a_crash_with_its_traceback() -> None:
    def run(data):
        return {}[data]

    finding = check(_target(run), b"\x01")[0]
    assert finding.kind == "crash" and "KeyError" in finding.detail


def test_assert_clean_fails_on_every_finding_and_names_the_input() -> None:
    """No finding is tolerated in the fuzz tests; the failure carries the input to add to FIXED_BUGS."""
    def run(data):
        raise OverflowError("int too large")

    with pytest.raises(AssertionError, match="crash in probe on input 01ff") as failure:
        assert_clean(_target(run), b"\x01\xff")
    assert "OverflowError" in str(failure.value)
    assert_clean(_target(lambda data: None), b"\x01\xff")


def test_slow_input_is_a_hang(monkeypatch) -> None:
    """The rule is elapsed > HANG_S, whatever HANG_S is: tested against 50 ms, not the real 1 s."""
    monkeypatch.setattr(fuzz_oracle, "HANG_S", 0.05)

    def run(data):
        time.sleep(0.15)

    finding = check(_target(run), b"")[0]
    assert finding.kind == "hang" and "limit 0.05 s" in finding.detail


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
