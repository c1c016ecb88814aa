"""How far a stage peer that lost steps may be shown the swarm went: the evidence, weighed without I/O.

A stage whose every peer died restarts from an older checkpoint while the trainers hold a later
step; its peer takes up that step (`StageService._resume_at`, docs/stage-rpc.md "A stage that lost
steps"), losing the updates between. What shows it the swarm's step must be something a stranger
cannot make up (adversary R3, docs/security.md). Announcements and `stage.info` answers are not:
a stranger announced as another stage's only peer, answering a far step, looks exactly like an
honest lone peer, and identities are free, so counting answers proves nothing.

The anchor is the job's progress record, `("job", id, "progress")`: the steps its submitter's
trainers saw committed, signed by the submitter (the job id hashes the spec with the submitter's
key, the DHT checks each record's signature, and `swarmd.values.DHTValues.progress` reads only the
submitter's). Such a step was committed by every stage, this one included, before its loss. The
answers of other stages' peers can only lower it: a record that out-lived a swarm-wide restore from
checkpoints still names a step nobody holds now, and no live peer of another stage answers it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

#: Reads the steps committed as the job's submitter signed them in its progress record, or None when
#: there is no such record (its submitter publishes none: no trainer of its own has committed a
#: step, or it is gone and the record lapsed). Built by `swarmd.jobs.serving.submitter_progress`.
ProgressAnchor = Callable[[], Awaitable[int | None]]


def proven_step(anchored: int | None, answered: Sequence[int] | None) -> int:
    """The most steps this stage may take to be committed swarm-wide; -1 when nothing shows any.

    `anchored`: the submitter's signed step (None: no record, so nothing is shown: an answer alone
    is one stranger's word). `answered`: the steps other stages' peers answered (-1 for a peer that
    did not); None for a one-stage job, which has no other stage to ask. One live answer at or past
    the anchored step is enough (the highest: a liar answering low cannot hold the stage back)."""
    if anchored is None:
        return -1
    if answered is None:
        return anchored
    return min(anchored, max(answered, default=-1))
