"""Storage bounds and expiry, without any network."""

import dataclasses

import pytest

from swarmd.dht import DHTConfig, RecordRejected, dht_key
from swarmd.dht.records import Record, sign_record
from swarmd.dht.storage import Storage
from transport.identity import Identity

NOW = 1_800_000_000.0
KEY = dht_key("job", "j1", "stage", 0)
PEERS = [Identity.from_seed(b"peer%d" % i) for i in range(8)]
SENDER = b"s" * 32


def rec(identity, value=b"v", ttl=60.0, key=KEY):
    return sign_record(identity, key, identity.peer_id, value, NOW + ttl)


def test_newest_expiration_wins_and_older_is_rejected():
    s = Storage(DHTConfig())
    s.put(rec(PEERS[0], b"new", 60), SENDER, NOW)
    with pytest.raises(RecordRejected, match="outdated"):
        s.put(rec(PEERS[0], b"old", 30), SENDER, NOW)
    s.put(rec(PEERS[0], b"newer", 90), SENDER, NOW)
    assert [r.value for r in s.get(KEY, NOW)] == [b"newer"]


def test_replayed_older_record_does_not_shorten_newer():
    """Hivemind's storage evicts the newer value early when a stale store is replayed.

    1. store a record expiring at +100; 2. replay an older one expiring at +10 (rejected);
    3. let the clock pass +10 and prune; 4. the +100 record is still readable until +100."""
    s = Storage(DHTConfig())
    s.put(rec(PEERS[0], b"new", 100), SENDER, NOW)
    older = rec(PEERS[0], b"old", 10)
    with pytest.raises(RecordRejected):
        s.put(older, SENDER, NOW)
    s.prune(NOW + 11)
    assert [r.value for r in s.get(KEY, NOW + 11)] == [b"new"]
    assert len(s) == 1
    s.prune(NOW + 101)
    assert s.get(KEY, NOW + 101) == [] and len(s) == 0


def test_same_record_twice_is_idempotent():
    s = Storage(DHTConfig())
    r = rec(PEERS[0])
    s.put(r, SENDER, NOW)
    s.put(r, SENDER, NOW)
    assert len(s) == 1 and s.total_bytes == r.size()


def test_far_future_expiry_clamped_to_max_ttl():
    s = Storage(DHTConfig(max_ttl=100.0))
    s.put(rec(PEERS[0], ttl=10 * 365 * 86400), SENDER, NOW)
    assert len(s.get(KEY, NOW + 99)) == 1
    assert s.get(KEY, NOW + 100.5) == []
    s.prune(NOW + 100.5)
    assert len(s) == 0


def test_expired_records_vanish_from_reads_at_once_and_from_memory_on_prune():
    s = Storage(DHTConfig())
    s.put(rec(PEERS[0], ttl=10), SENDER, NOW)
    s.put(rec(PEERS[1], ttl=50), SENDER, NOW)
    assert len(s.get(KEY, NOW + 10.01)) == 1
    assert len(s) == 2
    assert s.prune(NOW + 10.01) == 1
    assert len(s) == 1


def test_subkeys_per_key_limit_evicts_the_earliest_expiring():
    s = Storage(DHTConfig(max_subkeys_per_key=3))
    for i, ttl in enumerate([30, 10, 20]):
        s.put(rec(PEERS[i], ttl=ttl), SENDER, NOW)
    s.put(rec(PEERS[3], ttl=40), SENDER, NOW)
    assert {r.subkey for r in s.get(KEY, NOW)} == {PEERS[0].peer_id, PEERS[2].peer_id, PEERS[3].peer_id}
    with pytest.raises(RecordRejected, match="key_full"):
        s.put(rec(PEERS[4], ttl=5), SENDER, NOW)


def test_keys_per_node_limit():
    s = Storage(DHTConfig(max_keys=2))
    for i in range(2):
        s.put(rec(PEERS[0], key=dht_key("job", i)), SENDER, NOW)
    with pytest.raises(RecordRejected, match="storage_full"):
        s.put(rec(PEERS[0], key=dht_key("job", 9)), SENDER, NOW)


def test_total_bytes_limit():
    s = Storage(DHTConfig(max_total_bytes=200))
    s.put(rec(PEERS[0], b"x" * 100), SENDER, NOW)
    with pytest.raises(RecordRejected, match="storage_full"):
        s.put(rec(PEERS[1], b"x" * 100), SENDER, NOW)
    s.put(rec(PEERS[0], b"y" * 150, ttl=61), SENDER, NOW)  # replacing frees the old bytes first
    assert s.total_bytes == 32 + 150


def test_store_flood_from_one_peer_hits_its_quota_while_others_stay():
    """One signer floods many keys: it stops at its quota, others' records are untouched and
    others can still store."""
    cfg = DHTConfig(max_records_per_origin=5)
    s = Storage(cfg)
    s.put(rec(PEERS[1]), SENDER, NOW)
    rejected = 0
    for i in range(50):
        try:
            s.put(rec(PEERS[0], key=dht_key("job", i)), SENDER, NOW)
        except RecordRejected as e:
            assert e.reason == "quota"
            rejected += 1
    assert rejected == 45
    assert [r.subkey for r in s.get(KEY, NOW)] == [PEERS[1].peer_id]
    s.put(rec(PEERS[2]), SENDER, NOW)
    assert len(s.get(KEY, NOW)) == 2


def test_unsigned_open_records_count_against_their_sender():
    s = Storage(DHTConfig(max_records_per_origin=2))
    key = dht_key("open", "x")
    for i in range(2):
        s.put(Record(key, b"k%d" % i, b"v", NOW + 10), SENDER, NOW)
    with pytest.raises(RecordRejected, match="quota"):
        s.put(Record(key, b"k9", b"v", NOW + 10), SENDER, NOW)
    s.put(Record(key, b"k9", b"v", NOW + 10), b"o" * 32, NOW)


def test_expired_entry_is_replaced_even_by_an_older_signed_expiration():
    s = Storage(DHTConfig(max_ttl=10.0))
    s.put(rec(PEERS[0], b"a", ttl=1000), SENDER, NOW)  # clamped to NOW + 10
    s.put(rec(PEERS[0], b"b", ttl=500), SENDER, NOW + 20)
    assert [r.value for r in s.get(KEY, NOW + 20)] == [b"b"]


def test_rejected_store_changes_nothing():
    s = Storage(DHTConfig())
    s.put(rec(PEERS[0], ttl=60), SENDER, NOW)
    before = (len(s), s.total_bytes)
    bad = dataclasses.replace(rec(PEERS[1]), value=b"tampered")
    with pytest.raises(RecordRejected):
        s.put(bad, SENDER, NOW)
    assert (len(s), s.total_bytes) == before
