"""Storage bounds and expiry, without any network."""

import dataclasses

import pytest

from swarmd.dht import DHTConfig, RecordRejected, dht_key
from swarmd.dht.records import Record, sign_record
from swarmd.dht.storage import Storage
from swarmd.errors import ConfigError
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


def test_full_key_evicts_the_most_junior_subkey_of_the_largest_network():
    """Key of 4 slots: network A holds 3 (stored at t, t+1, t+2), B holds 1; a newcomer from C
    evicts A's most junior, however late any of them expires; a second from C is refused, since
    then no network holds two more than C."""
    s = Storage(DHTConfig(max_subkeys_per_key=4))
    for i in range(3):
        s.put(rec(PEERS[i], ttl=1000 - i), SENDER, NOW + i, "A")
    s.put(rec(PEERS[3], ttl=10), SENDER, NOW, "B")
    s.put(rec(PEERS[4], ttl=5), SENDER, NOW + 3, "C")
    assert {r.subkey for r in s.get(KEY, NOW + 3)} == {PEERS[i].peer_id for i in (0, 1, 3, 4)}
    with pytest.raises(RecordRejected, match="key_full"):
        s.put(rec(PEERS[5], ttl=5), SENDER, NOW + 3, "C")


def test_a_refreshed_record_outlives_newcomers_of_its_own_network():
    """Everyone on one network (loopback): the first writer keeps refreshing; however many
    identities come later, with however long expirations, the key refuses them once full."""
    s = Storage(DHTConfig(max_subkeys_per_key=3, max_subkeys_per_source=8))
    s.put(rec(PEERS[0], b"honest", ttl=90), SENDER, NOW, "lo")
    for i in range(1, 6):
        try:
            s.put(rec(PEERS[i], ttl=24 * 3600), SENDER, NOW + 1, "lo")
        except RecordRejected as e:
            assert e.reason == "key_full"
        s.put(rec(PEERS[0], b"honest", ttl=90 + i), SENDER, NOW + i, "lo")  # its refresh
    assert PEERS[0].peer_id in {r.subkey for r in s.get(KEY, NOW + 6)}


def test_one_network_holds_at_most_its_quota_of_one_key():
    s = Storage(DHTConfig(max_subkeys_per_source=2))
    s.put(rec(PEERS[0]), SENDER, NOW, "A")
    s.put(rec(PEERS[1]), SENDER, NOW, "A")
    with pytest.raises(RecordRejected, match="source_quota"):
        s.put(rec(PEERS[2]), SENDER, NOW, "A")
    s.put(rec(PEERS[2]), SENDER, NOW, "B")
    s.put(rec(PEERS[0], ttl=61), SENDER, NOW, "A")  # a refresh is never a new subkey
    s.put(rec(PEERS[3], key=dht_key("job", "other")), SENDER, NOW, "A")  # quotas are per key
    assert len(s) == 4


def test_expiry_cap_depends_on_the_key_kind():
    """An announcement key (peer rule) is held max_announce_ttl at most, an open one max_ttl."""
    cfg = DHTConfig(max_announce_ttl=150.0, max_ttl=3600.0)
    s = Storage(cfg)
    s.put(rec(PEERS[0], ttl=24 * 3600), SENDER, NOW)
    s.put(Record(dht_key("open", "x"), b"k", b"v", NOW + 24 * 3600), SENDER, NOW)
    assert len(s.get(KEY, NOW + 149)) == 1 and s.get(KEY, NOW + 151) == []
    assert len(s.get(dht_key("open", "x"), NOW + 3599)) == 1
    assert s.get(dht_key("open", "x"), NOW + 3601) == []


def test_sample_fits_its_budget_and_shares_it_between_networks():
    """A reads 1 record of A's own and 6 of network B: a budget of 3 records answers A's first
    and the two most senior of B's, not three of B's."""
    s = Storage(DHTConfig())
    for i in range(1, 7):
        s.put(rec(PEERS[i]), SENDER, NOW + i, "B")
    s.put(rec(PEERS[0], b"a"), SENDER, NOW + 9, "A")
    size = rec(PEERS[0], b"a").size()
    picked = s.sample(KEY, NOW + 10, 3 * size, lambda r: r.size())
    assert [r.subkey for r in picked] == [PEERS[1].peer_id, PEERS[0].peer_id, PEERS[2].peer_id]
    assert len(s.sample(KEY, NOW + 10, 10**6, lambda r: r.size())) == 7


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


def test_an_announcement_cap_below_the_refresh_period_is_a_config_error():
    with pytest.raises(ConfigError) as refused:
        DHTConfig(refresh_interval=200.0)
    assert refused.value.key == "max_announce_ttl"
    DHTConfig(refresh_interval=200.0, max_announce_ttl=1000.0)
