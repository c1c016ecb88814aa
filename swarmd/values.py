"""The one edge where swarmd's values read from the DHT become typed facts, or are dropped.

Why one edge: any peer may store a record under a stage, index or end key (the DHT checks only who
signed it), so every byte of a value is a stranger's until proven otherwise. A value whose fields had
the wrong type used to travel as a dict to the consumer, where an `int(...)` raised and killed the
stage sync and the gossip on every daemon. Here each kind of value has one strict schema, checked
once where the value is decoded: what passes is a frozen dataclass whose fields have their declared
types and bounds; what fails is dropped and counted by reason, never raised to a consumer. The
`DHTValues` reader is the only code that turns these keys' records into values.

The kinds, their keys and schemas:
- stage announcement, `("job", id, "stage", i)`: map `{addr, samples_per_s, queue, step, state}`,
  every field required and typed (`StageAnnouncement`); unknown extra keys (a newer daemon's) are
  ignored, up to `MAX_ANNOUNCEMENT_FIELDS` keys in all;
- jobs index, `("jobs",)`: a list of 32-byte job ids (`JobsIndex`); the reader keeps the newest
  `max_ids` of them (the submitter appends);
- job spec, `("job", id, "spec")`: `JobSpec.from_msgpack` (its own schema and bounds), signed by the
  index's submitter and hashing to the job id (`PublishedSpec`);
- end record, `("job", id, "end")`: map `{state, step, at, by}` (`JobEnd`).
Gossip load entries never pass through the DHT: their edge is `swarmd.rebalance.view.decode_entries`,
as strict (every field checked in `LoadEntry`).

Refusals are counted in the DHT node's refused-records counts (the
`swarmd_dht_refused_records_total{reason}` metric) under the closed set `VALUE_REFUSALS`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from swarmd.dht import dht_key
from swarmd.errors import PeerError
from swarmd.job import JobSpec, SpecError
from transport.errors import LocalProtocolError
from transport.pool import parse_address

log = logging.getLogger(__name__)

#: Metric reasons of the values this edge refuses (a closed set: each is a label value).
VALUE_REFUSALS = ("bad_announcement", "bad_job_index", "bad_job_spec", "bad_job_end", "bad_job_progress")

#: The peer states an announcement may carry ("stopping": a stage shutting down says so last).
ANNOUNCED_STATES = ("serving", "joining", "draining", "stopping")
#: Keys one announcement map may hold; ours has five, the rest is room for a newer daemon's fields.
MAX_ANNOUNCEMENT_FIELDS = 16
#: Characters of an announced `host:port` (a DNS name is at most 253, a port 5, the colon 1).
MAX_ADDR_CHARS = 260
#: Announced queue depth: a count of microbatches, far below this.
MAX_QUEUE = 1 << 31
#: Announced step: an optimizer step counter fits 63 bits (larger is a lie or garbage).
MAX_STEP = (1 << 63) - 1
#: Bytes of a job id: SHA-256 of the spec and its submitter's key (`JobSpec.job_id`).
JOB_ID_BYTES = 32
#: Ids one index record may list before the reader's own cap is applied (the format bound).
MAX_INDEX_IDS = 4096
#: The final states a job can reach swarm-wide ("failed" stays local: another trainer may go on).
END_STATES = ("done", "cancelled")
#: Characters of `by` (who ended the job) kept from a record; a longer one is refused.
MAX_BY_CHARS = 200
#: Bytes of an end record's value decoded at most (a real one takes under 300).
MAX_END_BYTES = 1024
#: Recent (steps committed, loss) pairs a progress record carries: what a daemon that did not submit
#: the job draws and logs; about the steps of one join interval at a fast job's pace.
MAX_PROGRESS_POINTS = 32
#: Bytes of a progress record's value decoded at most (a real one takes under 700).
MAX_PROGRESS_BYTES = 2048


class ValueRefused(PeerError, ValueError):
    """A value breaks its kind's schema; `reason` is one of VALUE_REFUSALS. Whoever wrote it is at
    fault (a PeerError); a ValueError too, as every decoder of bad bytes raises one."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class StageAnnouncement:
    """One peer's record for one stage, as it claims it (claims, not measurements: see
    `swarmd.jobs.probing` for what a daemon believes of them)."""

    peer_id: bytes  # the record's subkey: the signer's peer id (the DHT's peer rule)
    stage: int
    addr: str
    samples_per_s: float
    queue: int
    step: int
    state: str
    expires: float  # wall-clock time the record lapses


@dataclass(frozen=True)
class JobsIndex:
    """One submitter's entry in the `jobs` index: the ids of the jobs it published, oldest first."""

    submitter: bytes  # public key that signed the record
    job_ids: tuple[bytes, ...]


@dataclass(frozen=True)
class PublishedSpec:
    job_id: bytes
    submitter: bytes
    spec: JobSpec


@dataclass(frozen=True)
class JobEnd:
    """How a job ended: `state` at committed `step`, at wall time `at`, by whom (a sentence)."""

    state: str
    step: int
    at: float
    by: str

    def to_msgpack(self) -> bytes:
        return msgpack.packb({"state": self.state, "step": self.step, "at": self.at, "by": self.by},
                             use_bin_type=True)

    def text(self) -> str:
        """For people: `finished at step 4 (its trainers finished)`, `cancelled at step 2 by ...`."""
        if self.state == "done":
            return f"finished at step {self.step} ({self.by})"
        return f"cancelled at step {self.step} by {self.by}"

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "step": self.step, "at": self.at, "by": self.by}


@dataclass(frozen=True)
class JobProgress:
    """A job's progress as its submitter's daemon knows it (its own trainers' commits), published
    so that `swarmctl jobs`/`job` on every daemon show the step, loss and rate the job is at."""

    step: int
    loss: float | None
    samples_per_s: float
    at: float  # wall time the submitter's daemon stored it
    recent: tuple[tuple[int, float], ...] = ()  # (steps committed, loss), ascending, the last few
    # (steps committed, held-out loss) of the last few evaluations ([eval]), ascending; left out
    # of the record when empty, so a job without [eval] publishes what it did before.
    evaluated: tuple[tuple[int, float], ...] = ()

    def to_msgpack(self) -> bytes:
        fields = {"step": self.step, "loss": self.loss, "samples_per_s": self.samples_per_s, "at": self.at,
                  "recent": [list(p) for p in self.recent]}
        if self.evaluated:
            fields["evaluated"] = [list(p) for p in self.evaluated]
        return msgpack.packb(fields, use_bin_type=True)


# ------------------------------------------------------------------------------ schemas (pure)

def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _unpack(value: bytes, reason: str, *, max_len: int, arrays: int, maps: int) -> Any:
    """msgpack with every container and string bounded by `max_len` (the value's own size bounds
    them anyway; the limits keep msgpack from pre-allocating on a lying length prefix)."""
    try:
        return msgpack.unpackb(value, raw=False, strict_map_key=True, max_str_len=max_len, max_bin_len=max_len,
                               max_array_len=arrays, max_map_len=maps, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:
        raise ValueRefused(reason, f"not msgpack: {exc}") from None


def valid_addr(addr: Any) -> bool:
    """TCP `host:port` (never `unix:`) with a non-empty host of printable ASCII that the resolver
    accepts (no empty or over-long label) and a port in 1..65535."""
    if not isinstance(addr, str) or not 3 <= len(addr) <= MAX_ADDR_CHARS or not addr.isascii():
        return False
    host, sep, port = addr.rpartition(":")
    if not (sep and host and host.isprintable() and " " not in host and port.isdigit() and 1 <= int(port) <= 65535):
        return False
    try:  # a name the resolver cannot encode (`a..b`) would make every dial of it raise UnicodeError
        return isinstance(parse_address(addr), tuple)  # and `unix:/path` is a socket on our own host
    except LocalProtocolError:
        return False


def decode_announcement(value: bytes, peer_id: bytes, stage: int, expires: float) -> StageAnnouncement:
    """Raises ValueRefused("bad_announcement") naming the first field that breaks the schema."""
    fields = _unpack(value, "bad_announcement", max_len=len(value), arrays=0, maps=MAX_ANNOUNCEMENT_FIELDS)
    if not isinstance(fields, dict):
        raise ValueRefused("bad_announcement", "not a map")
    checks = (("addr", valid_addr), ("samples_per_s", lambda v: _is_real(v) and v >= 0),
              ("queue", lambda v: _is_int(v, 0, MAX_QUEUE)), ("step", lambda v: _is_int(v, 0, MAX_STEP)),
              ("state", lambda v: v in ANNOUNCED_STATES))
    for name, ok in checks:
        if name not in fields or not ok(fields[name]):
            raise ValueRefused("bad_announcement", f"field {name!r} is missing, mistyped or out of range")
    return StageAnnouncement(peer_id, stage, fields["addr"], float(fields["samples_per_s"]), fields["queue"],
                             fields["step"], fields["state"], expires)


def announcement_value(addr: str, fields: Mapping[str, Any]) -> bytes:
    """The value a stage peer announces: `{addr, samples_per_s, queue, step, state}`."""
    return msgpack.packb({"addr": addr, **fields}, use_bin_type=True)


def decode_index(value: bytes, submitter: bytes, max_ids: int) -> JobsIndex:
    """Raises ValueRefused("bad_job_index"); keeps the newest `max_ids` ids of a valid list."""
    ids = _unpack(value, "bad_job_index", max_len=len(value), arrays=MAX_INDEX_IDS, maps=0)
    if not isinstance(ids, list):
        raise ValueRefused("bad_job_index", "not a list")
    if not all(isinstance(i, bytes) and len(i) == JOB_ID_BYTES for i in ids):
        raise ValueRefused("bad_job_index", f"an entry is not a {JOB_ID_BYTES}-byte job id")
    newest = list(dict.fromkeys(ids))[-max_ids:] if max_ids > 0 else []
    return JobsIndex(submitter, tuple(newest))


def encode_index(job_ids: list[bytes]) -> bytes:
    return msgpack.packb(list(job_ids), use_bin_type=True)


def decode_spec(value: bytes, job_id: bytes, submitter: bytes) -> PublishedSpec:
    """Raises ValueRefused("bad_job_spec") unless the spec parses and hashes, with this submitter, to `job_id`."""
    try:
        spec = JobSpec.from_msgpack(value)
    except SpecError as exc:
        raise ValueRefused("bad_job_spec", f"{exc.field}: {exc.message}") from None
    if spec.job_id(submitter) != job_id:
        raise ValueRefused("bad_job_spec", "the spec does not hash to its job id with its signer's key")
    return PublishedSpec(job_id, submitter, spec)


def decode_end(value: bytes, steps: int) -> JobEnd:
    """Raises ValueRefused("bad_job_end") naming what is wrong; `steps` is the job's spec's."""
    if len(value) > MAX_END_BYTES:
        raise ValueRefused("bad_job_end", f"{len(value)} bytes, over MAX_END_BYTES ({MAX_END_BYTES})")
    fields = _unpack(value, "bad_job_end", max_len=MAX_END_BYTES, arrays=0, maps=8)
    if not isinstance(fields, dict):
        raise ValueRefused("bad_job_end", "not a map")
    state, step, at, by = (fields.get(k) for k in ("state", "step", "at", "by"))
    if state not in END_STATES:
        raise ValueRefused("bad_job_end", f"state {state!r} is not one of {END_STATES}")
    if not _is_int(step, 0, steps):
        raise ValueRefused("bad_job_end", f"step {step!r} is not in 0..{steps}")
    if not _is_real(at):
        raise ValueRefused("bad_job_end", f"at {at!r} is not a time")
    if not isinstance(by, str) or len(by) > MAX_BY_CHARS or not by.isprintable():
        # printable: `by` reaches every serving daemon's log and other users' terminals
        raise ValueRefused("bad_job_end", f"by is not printable text of at most {MAX_BY_CHARS} characters")
    return JobEnd(state, step, float(at), by)


def decode_progress(value: bytes, steps: int) -> JobProgress:
    """Raises ValueRefused("bad_job_progress") naming what is wrong; `steps` is the job's spec's."""
    if len(value) > MAX_PROGRESS_BYTES:
        raise ValueRefused("bad_job_progress", f"{len(value)} bytes, over MAX_PROGRESS_BYTES ({MAX_PROGRESS_BYTES})")
    fields = _unpack(value, "bad_job_progress", max_len=MAX_PROGRESS_BYTES, arrays=MAX_PROGRESS_POINTS, maps=8)
    if not isinstance(fields, dict):
        raise ValueRefused("bad_job_progress", "not a map")
    step, loss, rate, at = (fields.get(k) for k in ("step", "loss", "samples_per_s", "at"))
    recent, evaluated = (_progress_points(fields, name, steps) for name in ("recent", "evaluated"))
    if not _is_int(step, 0, steps):
        raise ValueRefused("bad_job_progress", f"step {step!r} is not in 0..{steps}")
    if loss is not None and not _is_real(loss):
        raise ValueRefused("bad_job_progress", f"loss {loss!r} is not a finite number")
    if not (_is_real(rate) and rate >= 0):
        raise ValueRefused("bad_job_progress", f"samples_per_s {rate!r} is not a finite rate")
    if not _is_real(at):
        raise ValueRefused("bad_job_progress", f"at {at!r} is not a time")
    return JobProgress(step, None if loss is None else float(loss), float(rate), float(at), recent, evaluated)


def _progress_points(fields: dict, name: str, steps: int) -> tuple[tuple[int, float], ...]:
    """A progress record's `name` list of [steps committed, loss] pairs: steps ascending in 1..steps."""
    points = fields.get(name, [])
    if not (isinstance(points, list) and all(isinstance(p, list) and len(p) == 2 and _is_int(p[0], 1, steps)
                                             and _is_real(p[1]) for p in points)):
        raise ValueRefused("bad_job_progress", f"{name} is not a list of [step in 1..{steps}, loss] pairs")
    if any(a[0] >= b[0] for a, b in zip(points, points[1:])):
        raise ValueRefused("bad_job_progress", f"{name} steps are not ascending")
    return tuple((n, float(x)) for n, x in points)


# ------------------------------------------------------------------------------ the reader

def stage_key(job_id: bytes, stage: int) -> bytes:
    return dht_key("job", job_id, "stage", stage)


def index_key() -> bytes:
    return dht_key("jobs")


def spec_key(job_id: bytes) -> bytes:
    return dht_key("job", job_id, "spec")


def end_key(job_id: bytes) -> bytes:
    return dht_key("job", job_id, "end")


def progress_key(job_id: bytes) -> bytes:
    return dht_key("job", job_id, "progress")


class DHTValues:
    """Reads each kind of value from a DHT node, decoded at this edge; refusals counted in `refused`
    (the node's own refused-records counts by default, so the metric shows them) and logged at
    debug level only: a stranger's bad record must not grow the log at its pace."""

    def __init__(self, dht: Any, refused: dict[str, int] | None = None) -> None:
        self.dht = dht
        if refused is None:  # the node's own dict (a test's stand-in without one: a dict of ours)
            refused = getattr(dht, "refused_records", None)
        self.refused = refused if refused is not None else {}

    def _refuse(self, exc: ValueRefused, record: Any) -> None:
        self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
        log.debug("refused a DHT value from peer %s: %s", record.subkey.hex()[:16], exc)

    async def announcements(self, job_id: bytes, stage: int, latest: bool = True) -> list[StageAnnouncement]:
        found = []
        for record in (await self.dht.get(stage_key(job_id, stage), latest=latest)).values():
            try:
                found.append(decode_announcement(record.value, record.subkey, stage, record.expiration))
            except ValueRefused as exc:
                self._refuse(exc, record)
        return found

    async def index(self, max_ids: int, latest: bool = True) -> list[JobsIndex]:
        found = []
        for record in (await self.dht.get(index_key(), latest=latest)).values():
            try:
                found.append(decode_index(record.value, record.public_key, max_ids))
            except ValueRefused as exc:
                self._refuse(exc, record)
        return found

    async def spec(self, job_id: bytes, submitter: bytes) -> PublishedSpec | None:
        """The spec `submitter` signed for `job_id`; records by anyone else are not looked at."""
        for record in (await self.dht.get(spec_key(job_id))).values():
            if record.public_key != submitter:
                continue
            try:
                return decode_spec(record.value, job_id, submitter)
            except ValueRefused as exc:
                self._refuse(exc, record)
        return None

    async def progress(self, job_id: bytes, submitter: bytes, steps: int, latest: bool = True) -> JobProgress | None:
        """The progress the submitter signed; anyone else's record under the key is not read (the
        node checked each record's signature and that its subkey is its signer's peer id)."""
        progress = None
        for record in (await self.dht.get(progress_key(job_id), latest=latest)).values():
            if record.public_key != submitter:
                continue
            try:
                progress = decode_progress(record.value, steps)
            except ValueRefused as exc:
                self._refuse(exc, record)
        return progress

    async def end(self, job_id: bytes, submitter: bytes, steps: int) -> tuple[JobEnd | None, list[bytes]]:
        """The end the submitter signed, and the peer ids of everyone else who stored one (forgers:
        never believed; the caller names them)."""
        end, forgers = None, []
        for record in (await self.dht.get(end_key(job_id), latest=True)).values():
            if record.public_key != submitter:
                forgers.append(record.signer or record.subkey)
                continue
            try:
                end = decode_end(record.value, steps)
            except ValueRefused as exc:
                self._refuse(exc, record)
        return end, forgers
