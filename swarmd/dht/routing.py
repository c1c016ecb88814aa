"""The Kademlia routing table: k-buckets over 256-bit ids, split as in the paper, with limits.

Pure: no I/O, time comes in as an argument. A contact enters only after it answered us or called us
over a connection whose handshake proved its id, so a peer cannot choose where it sits (its id is
SHA-256 of its public key) nor plant contacts it does not control.
"""

from __future__ import annotations

import functools
import heapq
import ipaddress
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from .config import DHTConfig

ID_BITS = 256


def id_int(peer_id: bytes) -> int:
    return int.from_bytes(peer_id, "big")


def distance(a: bytes, b: bytes) -> int:
    return id_int(a) ^ id_int(b)


@dataclass(slots=True)
class Contact:
    peer_id: bytes
    address: str
    last_seen: float = 0.0
    failures: int = 0
    prefix: str | None = None  # network for the per-prefix limits (None: exempt)
    number: int = field(init=False, repr=False)  # the id as an integer, for XOR without re-parsing

    def __post_init__(self) -> None:
        self.number = id_int(self.peer_id)


def address_prefix(address: str, config: DHTConfig) -> str | None:
    """The network a contact's address belongs to for the per-prefix limits; None when exempt."""
    return _prefix(address, config.ipv4_prefix_bits, config.ipv6_prefix_bits, config.prefix_limit_exempt_loopback)


@functools.lru_cache(maxsize=8192)  # parsing addresses dominated many-node simulations
def _prefix(address: str, v4_bits: int, v6_bits: int, exempt_loopback: bool) -> str | None:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host  # a host name: its own "prefix"
    if ip.is_loopback and exempt_loopback:
        return None
    bits = v4_bits if ip.version == 4 else v6_bits
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


class Bucket:
    """Contacts whose ids fall in [lo, hi); `contacts` is oldest-seen first."""

    def __init__(self, lo: int, hi: int, depth: int) -> None:
        self.lo, self.hi, self.depth = lo, hi, depth
        self.contacts: OrderedDict[bytes, Contact] = OrderedDict()
        self.replacements: OrderedDict[bytes, Contact] = OrderedDict()
        self.last_lookup = 0.0

    def covers(self, value: int) -> bool:
        return self.lo <= value < self.hi

    def random_id(self, rng: random.Random) -> bytes:
        return rng.randrange(self.lo, self.hi).to_bytes(32, "big")


class RoutingTable:
    def __init__(self, own_id: bytes, config: DHTConfig, now: float) -> None:
        self.own_id = own_id
        self._own = id_int(own_id)
        self._config = config
        self.buckets = [Bucket(0, 1 << ID_BITS, 0)]
        self.buckets[0].last_lookup = now
        self._prefixes: Counter[str] = Counter()

    def __len__(self) -> int:
        return sum(len(b.contacts) for b in self.buckets)

    def bucket_for(self, peer_id: bytes) -> Bucket:
        value = id_int(peer_id)
        lo, hi = 0, len(self.buckets)
        while hi - lo > 1:  # buckets stay sorted by range
            mid = (lo + hi) // 2
            if self.buckets[mid].lo <= value:
                lo = mid
            else:
                hi = mid
        return self.buckets[lo]

    def get(self, peer_id: bytes) -> Contact | None:
        return self.bucket_for(peer_id).contacts.get(peer_id)

    def seen(self, peer_id: bytes, address: str, now: float) -> bool:
        """Record that `peer_id` (proven) is reachable at `address`; True if it just joined the table."""
        if peer_id == self.own_id:
            return False
        bucket = self.bucket_for(peer_id)
        known = bucket.contacts.get(peer_id)
        if known is not None:
            if known.address != address:
                self._count(known.prefix, -1)
                known.address, known.prefix = address, address_prefix(address, self._config)
                self._count(known.prefix, +1)
            known.last_seen, known.failures = now, 0
            bucket.contacts.move_to_end(peer_id)
            return False
        bucket.replacements.pop(peer_id, None)
        contact = Contact(peer_id, address, now, 0, address_prefix(address, self._config))
        while True:
            if not self._prefix_allows(bucket, contact.prefix):
                return False
            if len(bucket.contacts) < self._config.k:
                self._insert(bucket, contact)
                return True
            stale = next((c for c in bucket.contacts.values() if c.failures >= self._config.max_failures), None)
            if stale is not None:
                self._evict(bucket, stale.peer_id)
                self._insert(bucket, contact)
                return True
            if not self._may_split(bucket):
                bucket.replacements[peer_id] = contact
                while len(bucket.replacements) > self._config.replacement_cache:
                    bucket.replacements.popitem(last=False)
                return False
            self._split(bucket)
            bucket = self.bucket_for(peer_id)

    def failed(self, peer_id: bytes) -> None:
        """A call to `peer_id` went unanswered: count it; after max_failures swap in a replacement."""
        bucket = self.bucket_for(peer_id)
        contact = bucket.contacts.get(peer_id)
        if contact is None:
            bucket.replacements.pop(peer_id, None)
            return
        contact.failures += 1
        if contact.failures >= self._config.max_failures and bucket.replacements:
            self._evict(bucket, peer_id)
            _, fresh = bucket.replacements.popitem(last=True)
            if self._prefix_allows(bucket, fresh.prefix):
                self._insert(bucket, fresh)

    def remove(self, peer_id: bytes) -> None:
        bucket = self.bucket_for(peer_id)
        if peer_id in bucket.contacts:
            self._evict(bucket, peer_id)
        bucket.replacements.pop(peer_id, None)

    def nearest(self, target: bytes, count: int, include_failing: bool = True) -> list[Contact]:
        goal = id_int(target)
        everyone = (c for b in self.buckets for c in b.contacts.values() if include_failing or c.failures == 0)
        return heapq.nsmallest(count, everyone, key=lambda c: c.number ^ goal)

    def contacts(self) -> list[Contact]:
        return [c for b in self.buckets for c in b.contacts.values()]

    def touch(self, target: bytes, now: float) -> None:
        """A lookup for `target` ran: its bucket is not quiet."""
        self.bucket_for(target).last_lookup = now

    def quiet_buckets(self, now: float) -> list[Bucket]:
        return [b for b in self.buckets if now - b.last_lookup >= self._config.bucket_refresh_interval]

    def _may_split(self, bucket: Bucket) -> bool:
        if bucket.depth >= ID_BITS:
            return False
        return bucket.covers(self._own) or bucket.depth % self._config.split_every_bits != 0

    def _split(self, bucket: Bucket) -> None:
        mid = (bucket.lo + bucket.hi) // 2
        low, high = Bucket(bucket.lo, mid, bucket.depth + 1), Bucket(mid, bucket.hi, bucket.depth + 1)
        low.last_lookup = high.last_lookup = bucket.last_lookup
        for source, attr in ((bucket.contacts, "contacts"), (bucket.replacements, "replacements")):
            for pid, c in source.items():
                getattr(low if low.covers(c.number) else high, attr)[pid] = c
        i = self.buckets.index(bucket)
        self.buckets[i:i + 1] = [low, high]

    def _prefix_allows(self, bucket: Bucket, prefix: str | None) -> bool:
        if prefix is None:
            return True
        if self._prefixes[prefix] >= self._config.max_per_prefix_table:
            return False
        in_bucket = sum(1 for c in bucket.contacts.values() if c.prefix == prefix)
        return in_bucket < self._config.max_per_prefix_bucket

    def _insert(self, bucket: Bucket, contact: Contact) -> None:
        bucket.contacts[contact.peer_id] = contact
        self._count(contact.prefix, +1)

    def _evict(self, bucket: Bucket, peer_id: bytes) -> None:
        contact = bucket.contacts.pop(peer_id)
        self._count(contact.prefix, -1)

    def _count(self, prefix: str | None, delta: int) -> None:
        if prefix is not None:
            self._prefixes[prefix] += delta
            if self._prefixes[prefix] <= 0:
                del self._prefixes[prefix]
