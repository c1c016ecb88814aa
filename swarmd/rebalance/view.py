"""The gossiped load view: one signed entry per peer of a job, newest wins, old ones age out.

Each entry is signed by the peer it describes (Ed25519, `transport.identity`), over a message that
names the job, so no peer can speak for another and no entry can be replayed into another job.
This module is pure: `GossipView.merge(entries, now)` is all a network exchange needs. The push-pull
exchange over the transport sends `encode_entries(view.entries())` and merges what comes back from
`decode_entries`; the DHT stays the source of membership (pass `members` to `merge` to enforce it).
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

import msgpack

from swarmd.errors import PeerError
from swarmd.rebalance.table import STATES, PeerLoad, StageTable, bounded_speeds
from transport.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_of, verify

# Domain separation: a load-entry signature can never be mistaken for any other signed swarmd record.
SIGNING_DOMAIN = b"swarmd/load-entry/v1"
# Format bounds of one entry (part of the format, so not per view): job ids are short names,
# a pipeline never has 65k stages, a queue depth is a count of microbatches.
MAX_JOB_CHARS = 128
MAX_STAGE = 65535
MAX_QUEUE_DEPTH = 1 << 31


class RebalanceError(PeerError):
    """Root of the rebalancer's errors."""


class MalformedEntry(RebalanceError, ValueError):
    """A load entry or an encoded batch of them breaks the format; the message says which field."""


@dataclass(frozen=True)
class ViewLimits:
    """Bounds of one view, each checked before anything is stored or allocated."""

    # Peers one view holds: SWARM jobs run hundreds of peers; 4096 entries of ~180 B stay < 1 MiB.
    max_peers: int = 4096
    # Entries accepted from one exchange: one full view of the largest job.
    max_batch: int = 4096
    # Bytes of one encoded batch: max_batch entries of ~180 B, with room to spare.
    max_encoded_bytes: int = 1 << 20
    # An entry not refreshed for this long is dropped: its peer stopped publishing (gone or stuck).
    # Several gossip rounds of a few seconds each, so one lost exchange does not drop a live peer.
    max_age_s: float = 120.0
    # Clock skew tolerated on timestamps from the future; beyond it an entry would outlive its peer.
    max_future_s: float = 10.0

    def __post_init__(self):
        if min(self.max_peers, self.max_batch, self.max_encoded_bytes) < 1:
            raise ValueError("view limits must be positive")
        if self.max_age_s <= 0 or self.max_future_s < 0:
            raise ValueError("max_age_s must be positive and max_future_s non-negative")


DEFAULT_LIMITS = ViewLimits()


@dataclass(frozen=True)
class LoadEntry:
    """What one peer says about itself; construction validates every field."""

    public_key: bytes
    job: str
    stage: int
    samples_per_s: float
    queue_depth: int
    state: str
    timestamp: float
    signature: bytes
    peer_id: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        _check(isinstance(self.public_key, bytes) and len(self.public_key) == PUBLIC_KEY_BYTES, "public_key")
        _check(isinstance(self.job, str) and 0 < len(self.job) <= MAX_JOB_CHARS, "job")
        _check(_is_int(self.stage) and 0 <= self.stage <= MAX_STAGE, "stage")
        _check(_is_real(self.samples_per_s) and self.samples_per_s >= 0, "samples_per_s")
        _check(_is_int(self.queue_depth) and 0 <= self.queue_depth <= MAX_QUEUE_DEPTH, "queue_depth")
        _check(self.state in STATES, "state")
        _check(_is_real(self.timestamp), "timestamp")
        _check(isinstance(self.signature, bytes) and len(self.signature) == SIGNATURE_BYTES, "signature")
        object.__setattr__(self, "peer_id", peer_id_of(self.public_key))

    @classmethod
    def create(
        cls, identity: Identity, job: str, stage: int, samples_per_s: float, queue_depth: int, state: str,
        timestamp: float,
    ) -> "LoadEntry":
        message = _signed_message(identity.public_key, job, stage, float(samples_per_s), queue_depth, state, timestamp)
        return cls(identity.public_key, job, stage, float(samples_per_s), queue_depth, state, float(timestamp),
                   identity.sign(message))

    def verify(self) -> bool:
        message = _signed_message(self.public_key, self.job, self.stage, float(self.samples_per_s),
                                  self.queue_depth, self.state, float(self.timestamp))
        return verify(self.public_key, self.signature, message)

    def as_row(self) -> list:
        return [self.public_key, self.job, self.stage, float(self.samples_per_s), self.queue_depth, self.state,
                float(self.timestamp), self.signature]


def _signed_message(public_key: bytes, job: str, stage: int, sps: float, queue: int, state: str, ts: float) -> bytes:
    return msgpack.packb([SIGNING_DOMAIN, public_key, job, stage, sps, queue, state, ts], use_bin_type=True)


def _check(ok: bool, name: str) -> None:
    if not ok:
        raise MalformedEntry(f"load entry field {name!r} is missing, mistyped or out of range")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def encode_entries(entries: Iterable[LoadEntry]) -> bytes:
    return msgpack.packb([e.as_row() for e in entries], use_bin_type=True)


def decode_entries(data: bytes, limits: ViewLimits = DEFAULT_LIMITS) -> list[LoadEntry]:
    """Parse a batch strictly: any malformed byte or field fails the whole batch with MalformedEntry.

    Sizes are checked before parsing and msgpack's own limits cap what it may allocate.
    """
    if len(data) > limits.max_encoded_bytes:
        raise MalformedEntry(f"batch of {len(data)} bytes exceeds max_encoded_bytes={limits.max_encoded_bytes}")
    try:
        rows = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_array_len=max(limits.max_batch, 8), max_map_len=0, max_ext_len=0,
            max_str_len=MAX_JOB_CHARS * 4, max_bin_len=max(PUBLIC_KEY_BYTES, SIGNATURE_BYTES),
        )
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedEntry(f"batch is not valid msgpack: {exc}") from None
    if not isinstance(rows, list):
        raise MalformedEntry("batch must be a list of entries")
    if len(rows) > limits.max_batch:
        raise MalformedEntry(f"batch of {len(rows)} entries exceeds max_batch={limits.max_batch}")
    entries = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 8:
            raise MalformedEntry("each entry is a list of 8 fields")
        entries.append(LoadEntry(*row))
    return entries


@dataclass
class MergeResult:
    """What a merge did: newly stored entries, entries already superseded, refusals with reasons."""

    accepted: list[LoadEntry] = field(default_factory=list)
    stale: int = 0
    rejected: list[tuple[LoadEntry, str]] = field(default_factory=list)


class GossipView:
    """A job's load view as one peer holds it."""

    def __init__(self, job: str, limits: ViewLimits = DEFAULT_LIMITS):
        self.job = job
        self.limits = limits
        self._entries: dict[bytes, LoadEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, peer_id: bytes) -> LoadEntry | None:
        return self._entries.get(peer_id)

    def entries(self) -> list[LoadEntry]:
        return list(self._entries.values())

    def merge(self, entries: Iterable[LoadEntry], now: float, members: Container[bytes] | None = None) -> MergeResult:
        """Keep, per peer, the newest entry that verifies; report what was refused and why.

        Cheap checks run first and the signature last, so a flood of stale or foreign entries costs
        no cryptography. `members` (peer ids from the DHT) restricts who may appear at all.
        """
        result = MergeResult()
        for count, entry in enumerate(entries):
            if count >= self.limits.max_batch:
                result.rejected.append((entry, "batch limit"))
                continue
            reason = self._refusal(entry, now, members)
            if reason == "stale":
                result.stale += 1
            elif reason is not None:
                result.rejected.append((entry, reason))
            else:
                self._entries[entry.peer_id] = entry
                result.accepted.append(entry)
        return result

    def _refusal(self, entry: LoadEntry, now: float, members: Container[bytes] | None) -> str | None:
        if entry.job != self.job:
            return "other job"
        if members is not None and entry.peer_id not in members:
            return "not a member"
        if entry.timestamp > now + self.limits.max_future_s:
            return "from the future"
        if entry.timestamp < now - self.limits.max_age_s:
            return "expired"
        held = self._entries.get(entry.peer_id)
        if held is not None and held.timestamp >= entry.timestamp:
            return "stale"
        if held is None and len(self._entries) >= self.limits.max_peers and not self._evict_older(entry, now):
            return "view full"
        if not entry.verify():
            return "bad signature"
        return None

    def _evict_older(self, entry: LoadEntry, now: float) -> bool:
        """Make room for `entry` by dropping expired entries, else the oldest one if older than it."""
        self.expire(now)
        if len(self._entries) < self.limits.max_peers:
            return True
        oldest = min(self._entries.values(), key=lambda e: e.timestamp)
        if oldest.timestamp >= entry.timestamp:
            return False
        del self._entries[oldest.peer_id]
        return True

    def expire(self, now: float) -> int:
        """Drop entries older than max_age_s; returns how many went."""
        cutoff = now - self.limits.max_age_s
        gone = [pid for pid, e in self._entries.items() if e.timestamp < cutoff]
        for pid in gone:
            del self._entries[pid]
        return len(gone)

    def table(self, num_stages: int, now: float) -> StageTable:
        """The policy's input: live entries of this pipeline's stages (others are ignored, not fatal),
        each speed bounded by the others' (`bounded_speeds`: an entry is its own peer's claim)."""
        self.expire(now)
        live = [e for e in self._entries.values() if e.stage < num_stages]
        speeds = bounded_speeds({e.peer_id: float(e.samples_per_s) for e in live})
        return StageTable(num_stages, [PeerLoad(e.peer_id, e.stage, speeds[e.peer_id], e.state) for e in live])

