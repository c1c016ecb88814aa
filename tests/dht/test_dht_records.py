"""Record signing and the key schema: who may write what."""

import pytest

from swarmd.dht import DHTConfig, DHTUsageError, RecordRejected, dht_key
from swarmd.dht.records import Record, check_record, key_id, namespace_of, sign_record
from transport.identity import Identity

CFG = DHTConfig()
NOW = 1_800_000_000.0
ALICE = Identity.from_seed(b"alice")
MALLORY = Identity.from_seed(b"mallory")
KEY = dht_key("job", "j1", "stage", 0)


def test_dht_key_is_unambiguous_and_namespaced():
    assert dht_key("job", "a/b", "c") != dht_key("job", "a", "b/c")
    assert namespace_of(dht_key("job", "x", 3)) == "job"
    assert len(key_id(KEY)) == 32
    with pytest.raises(DHTUsageError):
        dht_key(3, "x")
    with pytest.raises(DHTUsageError):
        dht_key("job", 1.5)


def test_signed_record_by_its_owner_is_accepted():
    check_record(sign_record(ALICE, KEY, ALICE.peer_id, b"v", NOW + 60), CFG, NOW)


def test_forged_signature_rejected():
    good = sign_record(ALICE, KEY, ALICE.peer_id, b"v", NOW + 60)
    forged = Record(KEY, ALICE.peer_id, b"evil", good.expiration, good.signature, good.public_key)
    with pytest.raises(RecordRejected) as e:
        check_record(forged, CFG, NOW)
    assert e.value.reason == "bad_signature"


def test_changed_expiration_breaks_the_signature():
    good = sign_record(ALICE, KEY, ALICE.peer_id, b"v", NOW + 60)
    extended = Record(KEY, ALICE.peer_id, b"v", NOW + 6000, good.signature, good.public_key)
    with pytest.raises(RecordRejected, match="bad_signature"):
        check_record(extended, CFG, NOW)


def test_record_under_another_peers_subkey_rejected():
    record = sign_record(MALLORY, KEY, ALICE.peer_id, b"I am alice", NOW + 60)
    with pytest.raises(RecordRejected) as e:
        check_record(record, CFG, NOW)
    assert e.value.reason == "wrong_owner"


def test_unsigned_record_rejected_outside_open_namespaces():
    with pytest.raises(RecordRejected, match="unsigned"):
        check_record(Record(KEY, ALICE.peer_id, b"v", NOW + 60), CFG, NOW)


def test_open_namespace_takes_unsigned_records_under_any_subkey():
    key = dht_key("open", "scratch")
    check_record(Record(key, b"anything", b"v", NOW + 60), CFG, NOW)
    signed = sign_record(MALLORY, key, b"anything", b"v", NOW + 60)
    check_record(signed, CFG, NOW)
    tampered = Record(key, b"anything", b"w", signed.expiration, signed.signature, signed.public_key)
    with pytest.raises(RecordRejected, match="bad_signature"):
        check_record(tampered, CFG, NOW)


def test_oversized_value_rejected():
    record = sign_record(ALICE, KEY, ALICE.peer_id, b"x" * (CFG.max_value_bytes + 1), NOW + 60)
    with pytest.raises(RecordRejected, match="value_too_large"):
        check_record(record, CFG, NOW)


@pytest.mark.parametrize("record,reason", [
    (Record(KEY, ALICE.peer_id, b"v", NOW - 1), "expired"),
    (Record(KEY, ALICE.peer_id, b"v", float("inf")), "bad_expiration"),
    (Record(KEY, b"", b"v", NOW + 1), "bad_subkey"),
    (Record(b"\xc1", ALICE.peer_id, b"v", NOW + 1), "bad_key"),
    (Record(b"k" * 300, ALICE.peer_id, b"v", NOW + 1), "bad_key"),
])
def test_malformed_records_rejected_with_a_reason(record, reason):
    with pytest.raises(RecordRejected) as e:
        check_record(record, CFG, NOW)
    assert e.value.reason == reason


def test_supersedes_is_newest_expiration_then_deterministic():
    old = sign_record(ALICE, KEY, ALICE.peer_id, b"old", NOW + 10)
    new = sign_record(ALICE, KEY, ALICE.peer_id, b"new", NOW + 20)
    assert new.supersedes(old) and not old.supersedes(new)
    a = sign_record(ALICE, KEY, ALICE.peer_id, b"a", NOW + 10)
    assert a.supersedes(old) != old.supersedes(a)
