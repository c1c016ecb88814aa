"""The routing table as a data structure: splits, replacement caches, failures, prefix limits."""

import hashlib
import random

from swarmd.dht import DHTConfig
from swarmd.dht.routing import RoutingTable, distance


def pid(i: int) -> bytes:
    return hashlib.sha256(b"peer%d" % i).digest()


def addr(i: int) -> str:
    return f"10.{(i >> 8) & 255}.{i & 255}.1:7000"


OWN = pid(-1)


def test_table_splits_and_nearest_matches_brute_force():
    table = RoutingTable(OWN, DHTConfig(), 0.0)
    for i in range(2000):
        table.seen(pid(i), addr(i), 1.0)
    assert len(table.buckets) > 5
    assert all(len(b.contacts) <= 20 for b in table.buckets)
    rng = random.Random(0)
    held = [c.peer_id for c in table.contacts()]
    for _ in range(20):
        target = rng.randbytes(32)
        brute = sorted(held, key=lambda p: distance(p, target))[:20]
        assert [c.peer_id for c in table.nearest(target, 20)] == brute


def test_bucket_covering_own_id_splits_and_far_buckets_use_the_relaxed_rule():
    """With b=5, a bucket not containing our id still splits until its depth is a multiple of 5,
    so the far half of the id space ends up in 2**4 buckets at depth 5, not in one bucket."""
    cfg = DHTConfig()
    table = RoutingTable(OWN, cfg, 0.0)
    for i in range(5000):
        table.seen(pid(i), addr(i), 1.0)
    own_bit = OWN[0] >> 7
    far = [b for b in table.buckets if (b.lo >> 255) != own_bit]
    assert {b.depth for b in far} == {5}
    assert len(far) == 16


def full_far_bucket(cfg: DHTConfig):
    """A table whose far bucket (no own id, depth 5) is full; returns the table and more ids for it."""
    table = RoutingTable(OWN, cfg, 0.0)
    spare = []
    for i in range(5000):
        table.seen(pid(i), addr(i), 1.0)
    bucket = table.bucket_for(pid(0))
    spare = [pid(i) for i in range(5000, 20000) if table.bucket_for(pid(i)) is bucket]
    assert len(bucket.contacts) == cfg.k
    return table, bucket, spare


def test_full_bucket_keeps_old_contacts_and_caches_newcomers():
    table, bucket, spare = full_far_bucket(DHTConfig())
    before = list(bucket.contacts)
    assert table.seen(spare[0], "10.200.0.1:7000", 2.0) is False
    assert list(bucket.contacts) == before
    assert spare[0] in bucket.replacements


def test_dead_contact_not_evicted_on_first_miss_but_after_max_failures():
    cfg = DHTConfig(max_failures=3)
    table, bucket, spare = full_far_bucket(cfg)
    table.seen(spare[0], "10.200.0.1:7000", 2.0)
    victim = next(iter(bucket.contacts))
    table.failed(victim)
    table.failed(victim)
    assert victim in bucket.contacts and bucket.contacts[victim].failures == 2
    table.failed(victim)
    assert victim not in bucket.contacts
    assert spare[0] in bucket.contacts and spare[0] not in bucket.replacements


def test_failing_contact_without_replacement_stays_then_yields_to_a_newcomer():
    cfg = DHTConfig(max_failures=2)
    table, bucket, spare = full_far_bucket(cfg)
    bucket.replacements.clear()
    victim = next(iter(bucket.contacts))
    for _ in range(5):
        table.failed(victim)
    assert victim in bucket.contacts  # nobody to replace it with: keep it
    assert table.seen(spare[0], "10.201.0.1:7000", 3.0) is True
    assert victim not in bucket.contacts


def test_an_answer_resets_the_failure_count():
    table = RoutingTable(OWN, DHTConfig(), 0.0)
    table.seen(pid(1), addr(1), 1.0)
    table.failed(pid(1))
    table.seen(pid(1), addr(1), 2.0)
    assert table.get(pid(1)).failures == 0


def test_per_prefix_limits_stop_one_subnet_filling_the_table():
    """After a table has split on diverse contacts, 100 contacts from one /24 get at most
    max_per_prefix_table entries, at most max_per_prefix_bucket in any bucket."""
    cfg = DHTConfig(max_per_prefix_bucket=2, max_per_prefix_table=5)
    table = RoutingTable(OWN, cfg, 0.0)
    for i in range(300):
        table.seen(pid(i), addr(i), 1.0)
    before = len(table)
    for i in range(1000, 1100):
        table.seen(pid(i), f"192.0.2.{i % 250}:7000", 1.0)
    subnet = [c for c in table.contacts() if c.address.startswith("192.0.2.")]
    assert 0 < len(subnet) <= 5
    assert len(table) <= before + 5
    for b in table.buckets:
        assert sum(1 for c in b.contacts.values() if c.address.startswith("192.0.2.")) <= 2


def test_ipv6_prefix_is_a_slash_64_by_default():
    cfg = DHTConfig(max_per_prefix_bucket=1)
    table = RoutingTable(OWN, cfg, 0.0)
    for i in range(10):
        table.seen(pid(i), f"[2001:db8::{i:x}]:7000", 1.0)
    assert len(table) == 1
    table.seen(pid(20), "[2001:db8:0:1::1]:7000", 1.0)
    assert len(table) == 2


def test_loopback_is_exempt_so_local_swarms_work():
    table = RoutingTable(OWN, DHTConfig(), 0.0)
    for i in range(100):
        table.seen(pid(i), f"127.0.0.1:{7000 + i}", 1.0)
    assert len(table) >= 40
    strict = RoutingTable(OWN, DHTConfig(prefix_limit_exempt_loopback=False), 0.0)
    for i in range(100):
        strict.seen(pid(i), f"127.0.0.1:{7000 + i}", 1.0)
    assert len(strict) == DHTConfig().max_per_prefix_bucket


def test_own_id_never_enters_the_table():
    table = RoutingTable(OWN, DHTConfig(), 0.0)
    assert table.seen(OWN, "10.0.0.1:1", 1.0) is False and len(table) == 0


def test_quiet_buckets_after_the_refresh_interval():
    cfg = DHTConfig(bucket_refresh_interval=100.0)
    table = RoutingTable(OWN, cfg, 0.0)
    for i in range(300):
        table.seen(pid(i), addr(i), 1.0)
    assert table.quiet_buckets(50.0) == []
    quiet = table.quiet_buckets(150.0)
    assert len(quiet) == len(table.buckets)
    table.touch(pid(0), 150.0)
    assert table.bucket_for(pid(0)) not in table.quiet_buckets(150.0)
    rid = quiet[0].random_id(random.Random(1))
    assert table.bucket_for(rid) is quiet[0]
