"""Fuzz targets of `swarmd.values`, the edge every DHT value of swarmd passes: stage announcements,
jobs index entries, job specs and end records. Kept beside fuzz_targets.py (same `Target` form, same
oracle) so the DHT value kinds can be registered there in one line; each target feeds the bytes to
the schema's decoder and to the `DHTValues` reader (as one signed record of a real key), which must
drop and count what its decoder refuses and never raise.
"""

from __future__ import annotations

import asyncio

import msgpack

from fuzz_oracle import InvariantBroken, Target
from fuzz_targets import MINIMAL_SPEC, NOW, _msgpack_bound

from swarmd.dht.records import sign_record
from swarmd.job.spec import parse_toml
from swarmd.values import (
    VALUE_REFUSALS, DHTValues, JobEnd, JobProgress, StageAnnouncement, ValueRefused, announcement_value,
    decode_announcement, decode_end, decode_index, decode_progress, decode_spec, end_key, index_key, progress_key,
    spec_key, stage_key,
)
from transport.identity import Identity

_SIGNER = Identity.from_seed(b"fuzz-values-signer")
JOB = b"\x07" * 32
STEPS = 100
MAX_IDS = 8


class _OneRecord:
    """A DHT node's `get` answering one signed record (the node's own checks are fuzzed as `dht`);
    an empty value is a tombstone, which a node never returns."""

    def __init__(self, key: bytes, value: bytes) -> None:
        self.record = sign_record(_SIGNER, key, _SIGNER.peer_id, value, NOW + 60)
        self.refused_records: dict[str, int] = {}

    async def get(self, key: bytes, latest: bool = False) -> dict:
        return {self.record.subkey: self.record} if key == self.record.key and self.record.value else {}


def _through_reader(key: bytes, data: bytes, read) -> tuple[object, dict[str, int]]:
    """Run one `DHTValues` read over a node holding `data` under `key`; it must never raise."""
    node = _OneRecord(key, data)
    result = asyncio.run(read(DHTValues(node)))
    if set(node.refused_records) - set(VALUE_REFUSALS) or sum(node.refused_records.values()) > 1:
        raise InvariantBroken(f"refusals counted outside VALUE_REFUSALS or twice: {node.refused_records}")
    return result, node.refused_records


def run_announcement(data: bytes) -> bool | None:
    if not data:
        return False  # a tombstone: the node never hands it to a reader
    try:
        found = decode_announcement(data, _SIGNER.peer_id, 3, NOW + 60)
    except ValueRefused:
        found = None
    listed, refused = _through_reader(stage_key(JOB, 3), data, lambda v: v.announcements(JOB, 3))
    if (found is None) != bool(refused) or listed != ([found] if found else []):
        raise InvariantBroken(f"the reader and the decoder disagree: {listed} vs {found}, {refused}")
    if found is not None:
        _check_announcement(found)
    return None


def _check_announcement(a: StageAnnouncement) -> None:
    typed = (isinstance(a.addr, str) and type(a.samples_per_s) is float and type(a.queue) is int
             and type(a.step) is int and a.state in ("serving", "joining", "draining", "stopping"))
    if not typed or not (a.samples_per_s >= 0 and a.samples_per_s != float("inf")):
        raise InvariantBroken(f"an accepted announcement has an untyped or unbounded field: {a}")


def run_index(data: bytes) -> bool | None:
    try:
        index = decode_index(data, _SIGNER.public_key, MAX_IDS)
    except ValueRefused:
        index = None
    if index is not None and (len(index.job_ids) > MAX_IDS or not all(len(i) == 32 for i in index.job_ids)):
        raise InvariantBroken(f"an accepted index holds {len(index.job_ids)} ids or a malformed one")
    _through_reader(index_key(), data, lambda v: v.index(MAX_IDS))
    return None


def run_end(data: bytes) -> bool | None:
    try:
        end = decode_end(data, STEPS)
    except ValueRefused:
        end = None
    if end is not None and not (end.state in ("done", "cancelled") and 0 <= end.step <= STEPS):
        raise InvariantBroken(f"an accepted end is out of its schema: {end}")
    (read, _), _ = _through_reader(end_key(JOB), data, lambda v: v.end(JOB, _SIGNER.public_key, STEPS))
    if read != end:
        raise InvariantBroken(f"the reader and the decoder disagree: {read} vs {end}")
    return None


def run_progress(data: bytes) -> bool | None:
    try:
        progress = decode_progress(data, STEPS)
    except ValueRefused:
        progress = None
    if progress is not None and not (0 <= progress.step <= STEPS and progress.samples_per_s >= 0):
        raise InvariantBroken(f"an accepted progress record is out of its schema: {progress}")
    read, _ = _through_reader(progress_key(JOB), data, lambda v: v.progress(JOB, _SIGNER.public_key, STEPS))
    if read != progress:
        raise InvariantBroken(f"the reader and the decoder disagree: {read} vs {progress}")
    return None


def run_spec(data: bytes) -> bool | None:
    """A published spec: the job id is the one the seed hashes to, so only an intact spec passes."""
    try:
        decode_spec(data, _SPEC_JOB, _SIGNER.public_key)
    except ValueRefused:
        pass
    _through_reader(spec_key(_SPEC_JOB), data, lambda v: v.spec(_SPEC_JOB, _SIGNER.public_key))
    return None


_SPEC = parse_toml(MINIMAL_SPEC)
_SPEC_JOB = _SPEC.job_id(_SIGNER.public_key)


def _pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _announcement_seeds() -> list[bytes]:
    honest = {"samples_per_s": 12.5, "queue": 2, "step": 40, "state": "serving"}
    return [announcement_value("127.0.0.1:7420", honest), announcement_value("[::1]:1", {**honest, "extra": [1]}),
            _pack({"addr": "h:1", "samples_per_s": 1.0, "queue": 0, "step": "oops", "state": "serving"}),
            _pack({"addr": "h:1", "samples_per_s": "fast", "queue": 0, "step": 1, "state": "serving"})]


def _index_seeds() -> list[bytes]:
    return [_pack([b"\x01" * 32, b"\x02" * 32]), _pack([b"\x01" * 32] * 20), _pack([]), _pack([b"short"])]


def _end_seeds() -> list[bytes]:
    return [JobEnd("done", 4, NOW, "its trainers").to_msgpack(), JobEnd("cancelled", 0, NOW, "x" * 200).to_msgpack()]


def _progress_seeds() -> list[bytes]:
    return [JobProgress(3, 2.5, 10.0, NOW).to_msgpack(), JobProgress(0, None, 0.0, NOW).to_msgpack(),
            _pack({"step": 1, "loss": float("nan"), "samples_per_s": 1.0, "at": NOW})]


def _spec_seeds() -> list[bytes]:
    return [_SPEC.to_msgpack(), parse_toml(MINIMAL_SPEC.replace("steps = 1", "steps = 2")).to_msgpack()]


ANNOUNCEMENT = Target("value_announcement", run_announcement, (), _msgpack_bound, _announcement_seeds,
                      "swarmd.values.decode_announcement and DHTValues.announcements")
INDEX = Target("value_index", run_index, (), _msgpack_bound, _index_seeds,
               "swarmd.values.decode_index and DHTValues.index")
END = Target("value_end", run_end, (), _msgpack_bound, _end_seeds, "swarmd.values.decode_end and DHTValues.end")
PROGRESS = Target("value_progress", run_progress, (), _msgpack_bound, _progress_seeds,
                  "swarmd.values.decode_progress and DHTValues.progress")
SPEC = Target("value_spec", run_spec, (), _msgpack_bound, _spec_seeds, "swarmd.values.decode_spec and DHTValues.spec")
VALUE_TARGETS: dict[str, Target] = {t.name: t for t in (ANNOUNCEMENT, INDEX, END, PROGRESS, SPEC)}
