"""The end record's rules without processes: only the submitter's signed record counts, and a
malformed one is refused with a reason (the daemons' side runs in test_jobs_ending_daemons.py)."""

from __future__ import annotations

import msgpack
import pytest

from swarmd.dht.records import sign_record
from swarmd.jobs.ending import MAX_BY_CHARS, JobEnd, end_key, submitters_end
from transport.identity import Identity

JOB = b"j" * 32
SUBMITTER, FORGER = Identity.from_seed(b"submitter"), Identity.from_seed(b"forger")


def record(identity: Identity, end: JobEnd | bytes):
    value = end if isinstance(end, bytes) else end.to_msgpack()
    return sign_record(identity, end_key(JOB), identity.peer_id, value, 2e9)


def test_the_submitters_record_is_believed_and_anyone_elses_is_named_as_forged() -> None:
    mine, forged = JobEnd("done", 4, 1.5e9, "its trainers"), JobEnd("cancelled", 0, 1.5e9, "a forger")
    records = {r.subkey: r for r in (record(SUBMITTER, mine), record(FORGER, forged))}
    end, forgers = submitters_end(records, SUBMITTER.public_key, steps=4)
    assert end == mine and forgers == [FORGER.peer_id]
    assert end.text() == "finished at step 4 (its trainers)"
    end, forgers = submitters_end({FORGER.peer_id: record(FORGER, forged)}, SUBMITTER.public_key, steps=4)
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
def test_a_malformed_end_is_refused_with_its_reason(fields, why) -> None:
    value = msgpack.packb(fields, use_bin_type=True)
    with pytest.raises(ValueError, match=why):
        JobEnd.from_msgpack(value, steps=4)
    end, _ = submitters_end({SUBMITTER.peer_id: record(SUBMITTER, value)}, SUBMITTER.public_key, steps=4)
    assert end is None


def test_an_oversized_end_is_not_decoded() -> None:
    with pytest.raises(ValueError, match="MAX_END_BYTES"):
        JobEnd.from_msgpack(b"\x00" * 2048, steps=4)
