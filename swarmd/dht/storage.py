"""The records one node holds for others, with every bound enforced before anything is kept.

Pure: no I/O, time comes in as an argument. Ordering is by the signed expiration (newest wins);
what a node keeps a record for is its *effective* expiry, the signed one clamped to now + the cap
of the key's kind (`ttl_cap`). A rejected store changes nothing: in particular the expiry queue is
only ever consulted against the entry currently held, so a replayed older record can never make a
newer one expire early.

Who gets a slot under a crowded key. Identities are free (a key pair per record), so neither the
signer nor the expiry can decide who stays: the old rule (evict the earliest expiry) let 512
throw-away identities with 24 h records push an honest 90 s announcement out in 8 RPCs. Slots are
shared instead by *source*, the network a store came from (`source_of`: a /24 or /48 by default),
which costs an attacker an address, not a key pair:
- one source holds at most `max_subkeys_per_source` subkeys of one key;
- a full key makes room for a newcomer only by evicting from the source that holds the most
  subkeys there, and only while that source holds at least two more than the newcomer's; the
  victim is that source's most junior subkey (latest first store), so a record that has been
  refreshed since it arrived outlives every newer one of its source.
A refresh keeps a subkey's seniority; its source becomes the refresher's.
Over every key together, one source holds at most `max_source_share` of the node's records
(`max_keys`) and bytes (`max_total_bytes`): else one address filled every key slot of a node with
fresh keys and the node refused every new job's announcements.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from .config import DHTConfig
from .errors import RecordRejected
from .records import Record, check_record, namespace_of
from .routing import _prefix

#: Source of the records a node stores on itself (its own announcements).
LOCAL_SOURCE = "local"


def source_of(host: str | None, config: DHTConfig) -> str:
    """The network a store came from, as slots are shared (`LOCAL_SOURCE` when we stored it).

    Loopback is one source like any other: on one host every process is one network."""
    if host is None:
        return LOCAL_SOURCE
    return _prefix(f"{host}:0", config.source_ipv4_prefix_bits, config.source_ipv6_prefix_bits, False) or host


@dataclass(slots=True)
class _Entry:
    record: Record
    expires: float  # effective (clamped) expiry, wall clock
    origin: bytes
    source: str
    since: float  # when this subkey was first stored here: seniority, kept across refreshes


class Storage:
    def __init__(self, config: DHTConfig) -> None:
        self._config = config
        self._keys: dict[bytes, dict[bytes, _Entry]] = {}
        self._sources: dict[bytes, Counter[str]] = {}
        self._heap: list[tuple[float, bytes, bytes]] = []
        self._per_origin: dict[bytes, int] = defaultdict(int)
        self._source_records: Counter[str] = Counter()
        self._source_bytes: Counter[str] = Counter()
        self.total_bytes = 0

    def __len__(self) -> int:
        return sum(len(sub) for sub in self._keys.values())

    def ttl_cap(self, key: bytes) -> float:
        """How long a record under `key` is held at most, by the key's kind: an announcement (any
        namespace with the peer rule) is re-stored every refresh period, so holding it longer than
        `max_announce_ttl` only serves a writer that stored once and left; open namespaces get
        `max_ttl`."""
        cfg = self._config
        if namespace_of(key) in cfg.open_namespaces:
            return cfg.max_ttl
        return min(cfg.max_ttl, cfg.max_announce_ttl)

    def put(self, record: Record, sender: bytes, now: float, source: str = LOCAL_SOURCE) -> None:
        """Hold `record` (received from peer `sender` on network `source`) or raise RecordRejected."""
        cfg = self._config
        check_record(record, cfg, now)
        expires = min(record.expiration, now + self.ttl_cap(record.key))
        origin = record.signer or sender
        old = self._live(record.key, record.subkey, now)
        if old is not None:
            if old.record == record:
                return
            if not record.supersedes(old.record):
                raise RecordRejected("outdated", "a record with a later expiration is held")
        if (old is None or old.origin != origin) and self._per_origin[origin] >= cfg.max_records_per_origin:
            raise RecordRejected("quota", "this origin holds its quota of records here")
        if record.key not in self._keys and len(self._keys) >= cfg.max_keys:
            raise RecordRejected("storage_full", "key limit reached")
        grow = record.size() - (old.record.size() if old else 0)
        if self.total_bytes + grow > cfg.max_total_bytes:
            raise RecordRejected("storage_full", "byte limit reached")
        self._check_share(record, old, source)
        victim = self._room_for(record.key, source, now) if old is None else None
        if victim is not None:
            self._drop(record.key, victim)
        if old is not None:
            self._drop(record.key, record.subkey)
        entry = _Entry(record, expires, origin, source, old.since if old is not None else now)
        self._keys.setdefault(record.key, {})[record.subkey] = entry
        self._sources.setdefault(record.key, Counter())[source] += 1
        self._per_origin[origin] += 1
        self._source_records[source] += 1
        self._source_bytes[source] += record.size()
        self.total_bytes += record.size()
        heapq.heappush(self._heap, (expires, record.key, record.subkey))

    def _live(self, key: bytes, subkey: bytes, now: float) -> _Entry | None:
        """The entry held for (key, subkey) if it has not expired; an expired one is dropped."""
        entry = self._keys.get(key, {}).get(subkey)
        if entry is not None and entry.expires <= now:
            self._drop(key, subkey)
            return None
        return entry

    def _check_share(self, record: Record, old: _Entry | None, source: str) -> None:
        """Refuse a store that would take `source` past its share of the node (`max_source_share`)."""
        if source == LOCAL_SOURCE:
            return
        cfg = self._config
        same = old is not None and old.source == source
        records = self._source_records[source] + (0 if same else 1)
        size = self._source_bytes[source] + record.size() - (old.record.size() if same else 0)
        if records > cfg.max_source_share * cfg.max_keys or size > cfg.max_source_share * cfg.max_total_bytes:
            raise RecordRejected("source_quota", f"this network holds {self._source_records[source]} records "
                                                 f"({self._source_bytes[source]} bytes), its share of this node")

    def _room_for(self, key: bytes, source: str, now: float) -> bytes | None:
        """Check a new subkey from `source` may enter `key`; the subkey to evict for it, if any."""
        cfg = self._config
        subkeys = self._keys.get(key)
        if not subkeys:
            return None
        counts = self._sources[key]
        if counts[source] >= cfg.max_subkeys_per_source:
            raise RecordRejected("source_quota", f"this network holds {counts[source]} subkeys of this key")
        if len(subkeys) < cfg.max_subkeys_per_key:
            return None
        for subkey in [s for s, e in subkeys.items() if e.expires <= now]:
            self._drop(key, subkey)
        if len(subkeys) < cfg.max_subkeys_per_key:
            return None
        top, held = counts.most_common(1)[0]
        if counts[source] + 2 > held:
            raise RecordRejected("key_full", "no network here holds more than its share of this key")
        return max((e for e in subkeys.values() if e.source == top), key=lambda e: e.since).record.subkey

    def get(self, key: bytes, now: float) -> list[Record]:
        """Live records under `key`, tombstones included (they must win merges at the reader)."""
        subkeys = self._keys.get(key)
        if not subkeys:
            return []
        return [e.record for e in subkeys.values() if e.expires > now]

    def sample(self, key: bytes, now: float, budget: int, cost: Callable[[Record], int]) -> list[Record]:
        """Live records under `key` whose `cost`s fit in `budget` bytes (a reply's share of the
        wire limit), chosen fairly: one record per source in turn, each source's most senior
        first, so a network that stuffed the key gets no more of the reply than any other."""
        subkeys = self._keys.get(key)
        if not subkeys:
            return []
        queues: dict[str, list[_Entry]] = {}
        for entry in sorted(subkeys.values(), key=lambda e: e.since):
            if entry.expires > now:
                queues.setdefault(entry.source, []).append(entry)
        out: list[Record] = []
        depth = 0
        while queues:
            for source in list(queues):
                queue = queues[source]
                if depth >= len(queue):
                    del queues[source]
                    continue
                size = cost(queue[depth].record)
                if size > budget:
                    return out
                budget -= size
                out.append(queue[depth].record)
            depth += 1
        return out

    def keys(self) -> list[bytes]:
        return list(self._keys)

    def prune(self, now: float) -> int:
        """Forget records whose effective expiry has passed; returns how many went."""
        dropped = 0
        while self._heap and self._heap[0][0] <= now:
            _, key, subkey = heapq.heappop(self._heap)
            entry = self._keys.get(key, {}).get(subkey)
            if entry is not None and entry.expires <= now:
                self._drop(key, subkey)
                dropped += 1
        if len(self._heap) > 2 * len(self) + 1024:
            self._heap = [(e.expires, k, s) for k, sub in self._keys.items() for s, e in sub.items()]
            heapq.heapify(self._heap)
        return dropped

    def _drop(self, key: bytes, subkey: bytes) -> None:
        subkeys = self._keys[key]
        entry = subkeys.pop(subkey)
        self._per_origin[entry.origin] -= 1
        if not self._per_origin[entry.origin]:
            del self._per_origin[entry.origin]
        for use, amount in ((self._source_records, 1), (self._source_bytes, entry.record.size())):
            use[entry.source] -= amount
            if not use[entry.source]:
                del use[entry.source]
        counts = self._sources[key]
        counts[entry.source] -= 1
        if not counts[entry.source]:
            del counts[entry.source]
        self.total_bytes -= entry.record.size()
        if not subkeys:
            del self._keys[key]
            del self._sources[key]
