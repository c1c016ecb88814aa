"""HelloGate: slots for connections still in their hello, per source and in total; a refusal takes
nothing and a slot given back lets exactly one more in."""

from __future__ import annotations

from transport.gate import HelloGate, source_of


def test_a_source_over_its_quota_is_refused_and_named_while_others_get_in():
    gate = HelloGate(per_source=2, total=10)
    assert gate.enter("10.0.0.1") is None and gate.enter("10.0.0.1") is None
    reason = gate.enter("10.0.0.1")
    assert reason is not None and "10.0.0.1 already has 2" in reason and "max_unproven_per_source" in reason
    assert gate.enter("10.0.0.2") is None
    assert gate.pending == 3  # the refusal took nothing


def test_the_total_counts_every_source():
    gate = HelloGate(per_source=5, total=2)
    assert gate.enter("a") is None and gate.enter("b") is None
    reason = gate.enter("c")
    assert reason is not None and "max_unproven_connections" in reason


def test_leaving_gives_the_slot_back_at_once():
    gate = HelloGate(per_source=1, total=1)
    assert gate.enter("a") is None
    assert gate.enter("a") is not None
    gate.leave("a")
    assert gate.pending == 0 and gate.enter("a") is None


def test_every_port_of_a_host_shares_its_quota_and_unix_clients_share_one():
    assert source_of(("10.0.0.1", 5000)) == source_of(("10.0.0.1", 6000)) == "10.0.0.1"
    assert source_of(("::1", 5000, 0, 0)) == "::1"
    assert source_of("") == source_of(None) == "unix"


def test_a_refusal_takes_nothing_so_one_leave_lets_exactly_one_in():
    gate = HelloGate(per_source=2, total=3)
    for source in ("a", "a", "b"):
        assert gate.enter(source) is None
    assert gate.enter("a") is not None and gate.enter("c") is not None  # per source, then total
    gate.leave("b")
    assert gate.enter("c") is None
    assert gate.enter("c") is not None and gate.pending == 3


def test_a_source_that_left_every_slot_starts_from_a_full_quota_and_others_keep_theirs():
    gate = HelloGate(per_source=2, total=10)
    for source in ("a", "a", "b", "b"):
        assert gate.enter(source) is None
    gate.leave("a")
    gate.leave("a")
    assert gate.enter("a") is None and gate.enter("a") is None and gate.enter("a") is not None
    assert gate.enter("b") is not None  # b's two slots are still held


def test_the_total_is_checked_before_the_source_quota():
    gate = HelloGate(per_source=1, total=1)
    assert gate.enter("a") is None
    reason = gate.enter("a")
    assert reason is not None and "max_unproven_connections" in reason
