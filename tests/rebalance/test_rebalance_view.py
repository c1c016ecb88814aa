"""The gossip view as a data structure: signed entries, merge rules, bounds, convergence by push-pull."""

import dataclasses
import random

import msgpack
import pytest

from swarmd.rebalance.view import (
    GossipView, LoadEntry, MalformedEntry, ViewLimits, decode_entries, encode_entries,
)
from transport.identity import Identity

JOB = "job-a"


def ident(i: int) -> Identity:
    return Identity.from_seed(f"peer-{i}".encode())


def entry(i: int, ts: float, stage: int = 0, state: str = "serving", job: str = JOB) -> LoadEntry:
    return LoadEntry.create(ident(i), job, stage, 2.5, 3, state, ts)


def test_entry_round_trips_through_msgpack_and_verifies():
    entries = [entry(i, 100.0 + i, stage=i % 3) for i in range(5)]
    decoded = decode_entries(encode_entries(entries))
    assert decoded == entries
    assert all(e.verify() for e in decoded)
    assert decoded[0].peer_id == ident(0).peer_id


def test_newest_entry_per_peer_wins_and_older_is_stale():
    view = GossipView(JOB)
    assert len(view.merge([entry(1, 10.0)], now=10.0).accepted) == 1
    newer = entry(1, 20.0, stage=2)
    assert view.merge([newer], now=20.0).accepted == [newer]
    result = view.merge([entry(1, 15.0), newer], now=20.0)
    assert result.accepted == [] and result.stale == 2 and result.rejected == []
    assert view.get(ident(1).peer_id).stage == 2


def test_entry_signed_by_another_key_is_rejected():
    """Mallory signs an entry claiming to be Alice: Alice's key, Mallory's signature."""
    alice, mallory = ident(1), ident(2)
    forged_by_mallory = LoadEntry.create(mallory, JOB, 0, 99.0, 0, "serving", 10.0)
    forged = dataclasses.replace(forged_by_mallory, public_key=alice.public_key)
    result = GossipView(JOB).merge([forged], now=10.0)
    assert result.rejected == [(forged, "bad signature")]


@pytest.mark.parametrize(
    "change", [{"stage": 3}, {"samples_per_s": 1000.0}, {"queue_depth": 0}, {"state": "draining"},
               {"timestamp": 11.0}],
)
def test_tampered_field_is_rejected(change):
    view = GossipView(JOB)
    tampered = dataclasses.replace(entry(1, 10.0), **change)
    assert view.merge([tampered], now=11.0).rejected == [(tampered, "bad signature")]
    assert len(view) == 0


def test_entry_signed_for_another_job_cannot_be_replayed_into_this_one():
    other = entry(1, 10.0, job="job-b")
    assert GossipView(JOB).merge([other], now=10.0).rejected == [(other, "other job")]
    relabelled = dataclasses.replace(other, job=JOB)
    assert GossipView(JOB).merge([relabelled], now=10.0).rejected == [(relabelled, "bad signature")]


def test_expired_future_and_non_member_entries_are_refused():
    limits = ViewLimits(max_age_s=60.0, max_future_s=5.0)
    view = GossipView(JOB, limits)
    old, future, stranger = entry(1, 100.0), entry(2, 206.0), entry(3, 200.0)
    result = view.merge([old, future, stranger], now=200.0, members={ident(1).peer_id, ident(2).peer_id})
    assert [reason for _, reason in result.rejected] == ["expired", "from the future", "not a member"]


def test_entries_age_out():
    view = GossipView(JOB, ViewLimits(max_age_s=60.0))
    view.merge([entry(1, 100.0), entry(2, 150.0)], now=150.0)
    assert view.expire(now=170.0) == 1
    assert [e.peer_id for e in view.entries()] == [ident(2).peer_id]


def test_view_full_countermeasure_keeps_the_newest_and_refuses_older_strangers():
    """A view bounded to 3 peers: a fresher stranger evicts the oldest entry, a staler one is refused."""
    view = GossipView(JOB, ViewLimits(max_peers=3))
    view.merge([entry(i, 100.0 + i) for i in range(3)], now=105.0)
    assert view.merge([entry(9, 99.0)], now=105.0).rejected[0][1] == "view full"
    assert view.merge([entry(8, 104.0)], now=105.0).accepted
    assert len(view) == 3 and view.get(ident(0).peer_id) is None


def test_batch_limit_countermeasure_stops_oversized_merges():
    view = GossipView(JOB, ViewLimits(max_batch=2))
    result = view.merge([entry(i, 10.0) for i in range(4)], now=10.0)
    assert len(result.accepted) == 2 and [r for _, r in result.rejected] == ["batch limit"] * 2


def test_decode_rejects_oversized_bytes_and_batches_before_parsing():
    data = encode_entries([entry(i, 10.0) for i in range(3)])
    with pytest.raises(MalformedEntry, match="max_encoded_bytes"):
        decode_entries(data, ViewLimits(max_encoded_bytes=len(data) - 1))
    with pytest.raises(MalformedEntry):
        decode_entries(data, ViewLimits(max_batch=2))


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb({"a": 1}),
        msgpack.packb([[1, 2, 3]]),
        msgpack.packb([["k" * 32, JOB, 0, 1.0, 0, "serving", 1.0, b"s" * 64]]),  # key as str
        msgpack.packb([[b"k" * 31, JOB, 0, 1.0, 0, "serving", 1.0, b"s" * 64]]),  # short key
        msgpack.packb([[b"k" * 32, JOB, True, 1.0, 0, "serving", 1.0, b"s" * 64]]),  # bool stage
        msgpack.packb([[b"k" * 32, JOB, -1, 1.0, 0, "serving", 1.0, b"s" * 64]]),
        msgpack.packb([[b"k" * 32, JOB, 0, float("nan"), 0, "serving", 1.0, b"s" * 64]]),
        msgpack.packb([[b"k" * 32, JOB, 0, 1.0, 0, "asleep", 1.0, b"s" * 64]]),
        msgpack.packb([[b"k" * 32, "", 0, 1.0, 0, "serving", 1.0, b"s" * 64]]),
        msgpack.packb([[b"k" * 32, JOB, 0, 1.0, 0, "serving", float("inf"), b"s" * 64]]),
        msgpack.packb([[b"k" * 32, JOB, 0, 1.0, 0, "serving", 1.0, b"s" * 63]]),
    ],
)
def test_decode_rejects_malformed_input_with_a_typed_error(payload):
    with pytest.raises(MalformedEntry):
        decode_entries(payload)


def test_fifty_peers_converge_to_a_full_view_by_push_pull():
    """50 views, each starting with its own signed entry. Each round every peer picks a random partner,
    pulls the partner's view and pushes its own; after a few rounds every view holds all 50."""
    rng = random.Random(7)
    n, now = 50, 1000.0
    views = [GossipView(JOB) for _ in range(n)]
    for i, view in enumerate(views):
        view.merge([LoadEntry.create(ident(i), JOB, i % 4, 1.0 + i, i, "serving", now)], now)
    rounds = 0
    while any(len(v) < n for v in views):
        rounds += 1
        assert rounds <= 10, f"not converged after 10 rounds: {[len(v) for v in views]}"
        for i in range(n):
            j = rng.choice([k for k in range(n) if k != i])
            mine, theirs = views[i].entries(), views[j].entries()
            assert not views[i].merge(decode_entries(encode_entries(theirs)), now).rejected
            assert not views[j].merge(decode_entries(encode_entries(mine)), now).rejected
    assert rounds <= 8
    assert {e.peer_id for e in views[0].entries()} == {ident(i).peer_id for i in range(n)}


def test_table_from_view_ignores_expired_and_foreign_stages():
    view = GossipView(JOB, ViewLimits(max_age_s=60.0))
    view.merge([entry(1, 100.0, stage=0), entry(2, 150.0, stage=1), entry(3, 150.0, stage=7),
                entry(4, 150.0, stage=1, state="joining")], now=150.0)
    table = view.table(num_stages=2, now=170.0)
    assert table.serving == [0.0, 2.5] and table.expected == [0.0, 5.0]
