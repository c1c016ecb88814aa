"""A job's progress seen from a daemon that did not submit it, without processes: the submitter's
daemon stores its step, loss and rate when they change; another daemon shows them (before: `waiting,
step 0` and `loss -` while the job trained at step 18), believing only the submitter's record,
reading it at most every PROGRESS_READ_S, and refusing a malformed one with a reason."""

from __future__ import annotations

from types import SimpleNamespace

import msgpack
import pytest

from swarmd.dht.records import sign_record
from swarmd.jobs import registry as registry_module
from swarmd.jobs.registry import Job, JobRegistry
from swarmd.values import JobProgress, ValueRefused, decode_progress, progress_key
from transport.identity import Identity

JOB = b"p" * 32
SUBMITTER, STRANGER = Identity.from_seed(b"submitter"), Identity.from_seed(b"stranger")
SPEC = SimpleNamespace(steps=20, name="p", pipeline=SimpleNamespace(stages=2))


class Store:
    """What a DHT node does with announcements and reads (the lookup is not what this is about):
    `announce` stores the signed record at once, as re-announcing a key does."""

    def __init__(self) -> None:
        self.records: dict[tuple[bytes, bytes], object] = {}
        self.stores = self.reads = 0
        self.refused_records: dict[str, int] = {}

    def signer(self, identity: Identity) -> SimpleNamespace:
        def announce(key: bytes, value_fn):
            self.stores += 1
            self.records[(key, identity.peer_id)] = sign_record(identity, key, identity.peer_id, value_fn(), 2e9)
            return (key, identity.peer_id)
        return SimpleNamespace(announce=announce)

    async def get(self, key: bytes, latest: bool = False) -> dict:
        self.reads += 1
        return {sub: r for (k, sub), r in self.records.items() if k == key}


def test_the_submitters_progress_reaches_a_daemon_that_did_not_submit(monkeypatch) -> None:
    import asyncio

    store = Store()
    mine = JobRegistry(store.signer(SUBMITTER), SUBMITTER)
    theirs = JobRegistry(store, Identity.from_seed(b"reader"))
    local = mine.jobs[JOB] = Job(JOB, SPEC, SUBMITTER.public_key, local=True)
    remote = theirs.jobs[JOB] = Job(JOB, SPEC, SUBMITTER.public_key, local=False)
    theirs.listed = {JOB}

    mine.publish_progress()
    assert store.stores == 0  # step 0: nothing trained, nothing to say
    local.step, local.loss, local.samples_per_s = 18, 2.5, 40.0
    mine.publish_progress()
    mine.publish_progress()
    assert store.stores == 1  # unchanged: not stored again

    # A stranger's record under the key, claiming the job is nearly done, is not read.
    store.signer(STRANGER).announce(progress_key(JOB), lambda: JobProgress(19, 0.1, 1e9, 1.0).to_msgpack())
    asyncio.run(theirs.read_progress_of_listed())
    assert (remote.step, remote.loss, remote.samples_per_s, remote.state) == (18, 2.5, 40.0, "running")

    # Read at most every PROGRESS_READ_S, however often `jobs` is asked.
    reads = store.reads
    local.step = 19
    mine.publish_progress()
    asyncio.run(theirs.read_progress(remote))
    assert store.reads == reads and remote.step == 18
    monkeypatch.setattr(registry_module, "PROGRESS_READ_S", 0.0)
    asyncio.run(theirs.read_progress(remote))
    assert remote.step == 19


def test_the_submitters_recent_steps_become_step_events_elsewhere(monkeypatch) -> None:
    """`swarmctl logs` and `plot` on a daemon that did not submit the job: the recent (step, loss)
    pairs the submitter published become step events there, each step once, none before the
    reader's own step; a follower is woken by them."""
    import asyncio

    monkeypatch.setattr(registry_module, "PROGRESS_READ_S", 0.0)
    store = Store()
    mine = JobRegistry(store.signer(SUBMITTER), SUBMITTER)
    theirs = JobRegistry(store, Identity.from_seed(b"reader"))
    local = mine.jobs[JOB] = Job(JOB, SPEC, SUBMITTER.public_key, local=True)
    remote = theirs.jobs[JOB] = Job(JOB, SPEC, SUBMITTER.public_key, local=False)
    for step, loss in ((1, 3.0), (2, 2.9), (3, 2.8)):
        local.step, local.loss = step, loss
        local.event("step", f"shard 0: step {step - 1} committed")
    mine.publish_progress()
    asyncio.run(theirs.read_progress(remote))
    assert [(e["step"], e["loss"]) for e in remote.events if e["kind"] == "step"] == [(1, 3.0), (2, 2.9), (3, 2.8)]

    async def follow_two_more() -> list:
        seen = []
        async for event in theirs.events(remote, follow=True):
            seen.append(event["step"])
            if len(seen) == 5:
                return seen
    for step, loss in ((4, 2.7), (5, 2.6)):
        local.step, local.loss = step, loss
        local.event("step", f"shard 0: step {step - 1} committed")
    mine.publish_progress()
    assert asyncio.run(asyncio.wait_for(follow_two_more(), 10)) == [1, 2, 3, 4, 5]


def test_the_submitters_evaluations_reach_a_daemon_that_did_not_submit(monkeypatch) -> None:
    """A job with [eval]: the held-out losses of the submitter's step events are published with its
    progress; elsewhere `job.get` shows the last (eval_loss, eval_step) and the step events built
    from the record carry theirs, so `swarmctl logs` and `plot` show the eval curve there too."""
    import asyncio

    monkeypatch.setattr(registry_module, "PROGRESS_READ_S", 0.0)
    store = Store()
    mine = JobRegistry(store.signer(SUBMITTER), SUBMITTER)
    theirs = JobRegistry(store, Identity.from_seed(b"reader"))
    local = mine.jobs[JOB] = Job(JOB, SPEC, SUBMITTER.public_key, local=True)
    remote = theirs.jobs[JOB] = Job(JOB, SPEC, SUBMITTER.public_key, local=False)
    for step, loss in ((1, 3.0), (2, 2.9), (3, 2.8), (4, 2.7)):
        local.step, local.loss = step, loss
        held_out = {"eval_loss": loss / 2, "eval_step": step} if step % 2 == 0 else {}
        local.event("step", f"shard 0: step {step - 1} committed", **held_out)
        if held_out:
            local.eval_loss, local.eval_step = held_out["eval_loss"], step
    mine.publish_progress()
    asyncio.run(theirs.read_progress(remote))
    assert (remote.eval_loss, remote.eval_step) == (1.35, 4)
    assert [(e["step"], e.get("eval_loss")) for e in remote.events if e["kind"] == "step"] == \
        [(1, None), (2, 1.45), (3, None), (4, 1.35)]
    # An evaluation given up (no loss) publishes nothing new; a job without [eval] publishes no list.
    assert "evaluated" not in msgpack.unpackb(JobProgress(3, 1.0, 1.0, 1.0, ((3, 1.0),)).to_msgpack())


@pytest.mark.parametrize(("fields", "why"), [
    ({"step": 21, "loss": 1.0, "samples_per_s": 1.0, "at": 1.0}, "step"),
    ({"step": -1, "loss": 1.0, "samples_per_s": 1.0, "at": 1.0}, "step"),
    ({"step": 3, "loss": "low", "samples_per_s": 1.0, "at": 1.0}, "loss"),
    ({"step": 3, "loss": float("inf"), "samples_per_s": 1.0, "at": 1.0}, "loss"),
    ({"step": 3, "loss": 1.0, "samples_per_s": -1.0, "at": 1.0}, "samples_per_s"),
    ({"step": 3, "loss": 1.0, "samples_per_s": 1.0, "at": None}, "at"),
    ([3, 1.0], "not a map"),
    ({"step": 3, "loss": 1.0, "samples_per_s": 1.0, "at": 1.0, "recent": [[2, 1.0], [1, 1.0]]}, "ascending"),
    ({"step": 3, "loss": 1.0, "samples_per_s": 1.0, "at": 1.0, "recent": [[0, 1.0]]}, "recent"),
    ({"step": 3, "loss": 1.0, "samples_per_s": 1.0, "at": 1.0, "recent": [[1, "x"]]}, "recent"),
    ({"step": 3, "loss": 1.0, "samples_per_s": 1.0, "at": 1.0, "recent": [[1, 1.0]] * 40}, "not msgpack"),
    ({"step": 3, "loss": 1.0, "samples_per_s": 1.0, "at": 1.0, "evaluated": [[4, 1.0], [2, 1.0]]}, "evaluated steps"),
    ({"step": 3, "loss": 1.0, "samples_per_s": 1.0, "at": 1.0, "evaluated": [[21, 1.0]]}, "evaluated is not"),
    ({"step": 3, "loss": 1.0, "samples_per_s": 1.0, "at": 1.0, "evaluated": [[2, float("nan")]]}, "evaluated is"),
    ({"step": 3, "loss": 1.0, "samples_per_s": 1.0, "at": 1.0, "evaluated": {"2": 1.0}}, "evaluated is not"),
])
def test_a_malformed_progress_record_is_refused_with_its_reason(fields, why) -> None:
    with pytest.raises(ValueRefused, match=why):
        decode_progress(msgpack.packb(fields, use_bin_type=True), steps=20)
    with pytest.raises(ValueRefused, match="MAX_PROGRESS_BYTES"):
        decode_progress(b"\x00" * 4096, steps=20)
