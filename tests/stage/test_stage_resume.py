"""What shows a stage peer that lost steps how far the swarm went (swarmd/stage/resume.py), without
sockets: the job's submitter's signed progress record, capped by the other stages' answers, and
nothing a stranger can write (adversary R3, docs/security.md)."""

from __future__ import annotations

import time

import pytest

from swarmd.dht.config import DHTConfig
from swarmd.dht.errors import RecordRejected
from swarmd.dht.records import Record, check_record, sign_record
from swarmd.jobs.serving import submitter_progress
from swarmd.stage.resume import proven_step
from swarmd.values import DHTValues, JobProgress, progress_key
from transport.identity import Identity

JOB = b"r" * 32
STEPS = 20
SUBMITTER, STRANGER = Identity.from_seed(b"resume-submitter"), Identity.from_seed(b"resume-stranger")
EXPIRES = 2e9  # wall-clock seconds, far ahead


def progress_value(step: int, at: float | None = None) -> bytes:
    return JobProgress(step, 2.5, 40.0, time.time() if at is None else at).to_msgpack()


def signed(identity: Identity, step: int, at: float | None = None) -> Record:
    """A progress record under the job's key, signed by `identity` as the DHT's peer rule wants."""
    return sign_record(identity, progress_key(JOB), identity.peer_id, progress_value(step, at), EXPIRES)


class Records:
    """What a DHT node's get returns: the live records under a key, each already checked (signature,
    subkey = signer's peer id) as `swarmd.dht.node.DHTNode.get` does before it returns any."""

    def __init__(self, *records: Record) -> None:
        self.records = {r.subkey: r for r in records}
        self.refused_records: dict[str, int] = {}

    async def get(self, key: bytes, latest: bool = False) -> dict[bytes, Record]:
        return {s: r for s, r in self.records.items() if r.key == key}


async def anchored(*records: Record) -> int | None:
    """The step a stage's anchor reads from these records (the daemon's reader, `submitter_progress`)."""
    return await submitter_progress(DHTValues(Records(*records)), JOB, SUBMITTER.public_key, STEPS)()


def test_without_the_submitters_record_no_answer_shows_any_step():
    """No anchor: one stranger answering 15 for another stage (or any number of them: identities are
    free) shows nothing, nor does the trainer's call alone in a one-stage job."""
    assert proven_step(None, [15]) == -1
    assert proven_step(None, [15, 15, 15, 0]) == -1
    assert proven_step(None, None) == -1


def test_a_record_below_the_answers_caps_them():
    """The submitter signed 3 steps; an honest peer answers 3 and a stranger 15: the stage may take
    up 3 at most (a stale record, published before the last commit, caps it likewise)."""
    assert proven_step(3, [3, 15]) == 3
    assert proven_step(3, [15]) == 3


def test_a_record_above_the_answers_is_lowered_to_the_highest():
    """The submitter's record says 15 but the other stages answer at most 4 (the record out-lived a
    swarm-wide restore from checkpoints, or those peers are behind): 4. A liar answering low, or a
    peer not answering (-1), does not lower an honest answer."""
    assert proven_step(15, [4, 2, -1]) == 4
    assert proven_step(15, [0, 15]) == 15


def test_a_record_with_no_answering_peer_of_another_stage_shows_nothing():
    assert proven_step(5, []) == -1
    assert proven_step(5, [-1, -1]) == -1


def test_a_one_stage_job_has_only_the_record():
    """No other stage to ask: the record alone (before: the trainer's call alone, anyone's)."""
    assert proven_step(5, None) == 5


async def test_the_anchor_reads_the_submitters_record_only():
    """A stranger's record under the job's progress key (validly signed by the stranger, claiming 15)
    is not read: with it alone there is no anchor; beside the submitter's (3) the anchor is 3."""
    assert await anchored(signed(STRANGER, 15)) is None
    assert await anchored(signed(STRANGER, 15), signed(SUBMITTER, 3)) == 3
    assert proven_step(await anchored(signed(STRANGER, 15)), [15]) == -1


async def test_a_malformed_record_of_the_submitter_is_no_anchor():
    """The submitter's key, a step past the job's `steps`: refused at the values edge, counted."""
    values = DHTValues(Records(signed(SUBMITTER, STEPS + 1)))
    assert await submitter_progress(values, JOB, SUBMITTER.public_key, STEPS)() is None
    assert values.refused == {"bad_job_progress": 1}


def test_a_record_forged_in_the_submitters_name_is_refused_by_every_dht_store_and_read():
    """A stranger's record carrying the submitter's public key (or the submitter's peer id as its
    subkey) is refused by `check_record`, which every DHT store and every read of a replica's
    records applies, so it never reaches the anchor."""
    genuine = signed(STRANGER, 15)
    forged = Record(genuine.key, SUBMITTER.peer_id, genuine.value, genuine.expiration, genuine.signature,
                    SUBMITTER.public_key)
    with pytest.raises(RecordRejected) as refused:
        check_record(forged, DHTConfig(), time.time())
    assert refused.value.reason == "bad_signature"
    squatter = sign_record(STRANGER, progress_key(JOB), SUBMITTER.peer_id, progress_value(15), EXPIRES)
    with pytest.raises(RecordRejected) as refused:
        check_record(squatter, DHTConfig(), time.time())
    assert refused.value.reason == "wrong_owner"


async def test_an_old_record_still_anchors_its_step():
    """A record stored a day ago at step 4 still shows 4: a job whose stage was wiped stalls, so its
    submitter's step, and the record, stop changing exactly when the stage needs it. Its step, not
    its age, is what can be stale: below the call's step it shows too little (above)."""
    assert proven_step(await anchored(signed(SUBMITTER, 4, at=time.time() - 86400)), [4]) == 4
