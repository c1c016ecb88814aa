"""The records one node holds for others, with every bound enforced before anything is kept.

Pure: no I/O, time comes in as an argument. Ordering is by the signed expiration (newest wins);
what a node keeps a record for is its *effective* expiry, the signed one clamped to now + max_ttl.
A rejected store changes nothing: in particular the expiry queue is only ever consulted against the
entry currently held, so a replayed older record can never make a newer one expire early.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

from .config import DHTConfig
from .errors import RecordRejected
from .records import Record, check_record


@dataclass(slots=True)
class _Entry:
    record: Record
    expires: float  # effective (clamped) expiry, wall clock
    origin: bytes


class Storage:
    def __init__(self, config: DHTConfig) -> None:
        self._config = config
        self._keys: dict[bytes, dict[bytes, _Entry]] = {}
        self._heap: list[tuple[float, bytes, bytes]] = []
        self._per_origin: dict[bytes, int] = defaultdict(int)
        self.total_bytes = 0

    def __len__(self) -> int:
        return sum(len(sub) for sub in self._keys.values())

    def put(self, record: Record, sender: bytes, now: float) -> None:
        """Hold `record` (received from peer `sender`) or raise RecordRejected saying why."""
        cfg = self._config
        check_record(record, cfg, now)
        expires = min(record.expiration, now + cfg.max_ttl)
        origin = record.signer or sender
        subkeys = self._keys.get(record.key)
        old = subkeys.get(record.subkey) if subkeys else None
        if old is not None and old.expires > now:
            if old.record == record:
                return
            if not record.supersedes(old.record):
                raise RecordRejected("outdated", "a record with a later expiration is held")
        if old is not None and old.expires <= now:
            self._drop(record.key, record.subkey)
            subkeys = self._keys.get(record.key)
            old = None
        if (old is None or old.origin != origin) and self._per_origin[origin] >= cfg.max_records_per_origin:
            raise RecordRejected("quota", "this origin holds its quota of records here")
        if subkeys is None and len(self._keys) >= cfg.max_keys:
            raise RecordRejected("storage_full", "key limit reached")
        grow = record.size() - (old.record.size() if old else 0)
        if self.total_bytes + grow > cfg.max_total_bytes:
            raise RecordRejected("storage_full", "byte limit reached")
        if old is None and subkeys is not None and len(subkeys) >= cfg.max_subkeys_per_key:
            victim = min(subkeys.values(), key=lambda e: e.expires)
            if victim.expires >= expires:
                raise RecordRejected("key_full", "every held subkey expires later")
            self._drop(record.key, victim.record.subkey)
        if old is not None:
            self._drop(record.key, record.subkey)
        self._keys.setdefault(record.key, {})[record.subkey] = _Entry(record, expires, origin)
        self._per_origin[origin] += 1
        self.total_bytes += record.size()
        heapq.heappush(self._heap, (expires, record.key, record.subkey))

    def get(self, key: bytes, now: float) -> list[Record]:
        """Live records under `key`, tombstones included (they must win merges at the reader)."""
        subkeys = self._keys.get(key)
        if not subkeys:
            return []
        return [e.record for e in subkeys.values() if e.expires > now]

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
        self.total_bytes -= entry.record.size()
        if not subkeys:
            del self._keys[key]
