"""The end record's rules without processes: only the submitter's signed record counts, and a
malformed one is refused with a reason and counted (the daemons' side runs in
test_jobs_ending_daemons.py)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from swarmd.dht.records import sign_record
from swarmd.values import MAX_BY_CHARS, DHTValues, JobEnd, ValueRefused, decode_end, end_key
from transport.identity import Identity

JOB = b"j" * 32
SUBMITTER, FORGER = Identity.from_seed(b"submitter"), Identity.from_seed(b"forger")


class Records:
    """What `DHTNode.get` answers for the end key: verified records by subkey (the signatures
    are real; the lookup is not what these rules are about)."""

    def __init__(self, *records) -> None:
        self.records = {r.subkey: r for r in records}
        self.refused_records: dict[str, int] = {}

    async def get(self, key: bytes, latest: bool = False) -> dict:
        return {s: r for s, r in self.records.items() if r.key == key}


def record(identity: Identity, end: JobEnd | bytes):
    value = end if isinstance(end, bytes) else end.to_msgpack()
    return sign_record(identity, end_key(JOB), identity.peer_id, value, 2e9)


def read_end(dht: Records) -> tuple[JobEnd | None, list[bytes]]:
    return asyncio.run(DHTValues(dht).end(JOB, SUBMITTER.public_key, steps=4))


def test_the_submitters_record_is_believed_and_anyone_elses_is_named_as_forged() -> None:
    mine, forged = JobEnd("done", 4, 1.5e9, "its trainers"), JobEnd("cancelled", 0, 1.5e9, "a forger")
    end, forgers = read_end(Records(record(SUBMITTER, mine), record(FORGER, forged)))
    assert end == mine and forgers == [FORGER.peer_id]
    assert end.text() == "finished at step 4 (its trainers)"
    end, forgers = read_end(Records(record(FORGER, forged)))
    assert end is None and forgers == [FORGER.peer_id]


@pytest.mark.parametrize(("fields", "why"), [
    ({"state": "failed", "step": 1, "at": 1.0, "by": "x"}, "state"),
    ({"state": "done", "step": 5, "at": 1.0, "by": "x"}, "step"),
    ({"state": "done", "step": True, "at": 1.0, "by": "x"}, "step"),
    ({"state": "done", "step": 1, "at": float("nan"), "by": "x"}, "at"),
    ({"state": "done", "step": 1, "at": 1.0, "by": "x" * (MAX_BY_CHARS + 1)}, "by"),
    ("a string", "not a map"),
    ([1, 2], "not msgpack"),  # no arrays in an end record: refused while decoding
])
def test_a_malformed_end_is_refused_with_its_reason_and_counted(fields, why) -> None:
    value = msgpack.packb(fields, use_bin_type=True)
    with pytest.raises(ValueRefused, match=why):
        decode_end(value, steps=4)
    dht = Records(record(SUBMITTER, value))
    end, _ = read_end(dht)
    assert end is None and dht.refused_records == {"bad_job_end": 1}


def test_an_oversized_end_is_not_decoded() -> None:
    with pytest.raises(ValueRefused, match="MAX_END_BYTES"):
        decode_end(b"\x00" * 2048, steps=4)
