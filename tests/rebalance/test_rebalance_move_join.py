"""A rebalancing move and a join on one daemon never run at once (`Serving`'s join lock): a move asked
for during a join is skipped with its reason, a join asked for during a move waits and then finds the
stage the move brought in. Without the lock both would start a service for the same stage.

In-process: the stage services are stand-ins whose start waits on a gate, because what is tested is
the order `Serving` runs them in (the moves themselves run between real daemons in
tests/rebalance/test_rebalance_daemons.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from waiting import until

import swarmd.jobs.serving as serving_module
from swarmd.job.spec import JobSpec
from swarmd.directory import StagePeer, StaticDirectory
from swarmd.jobs.probing import UNANSWERED, Probe
from swarmd.jobs.serving import Served, Serving
from swarmd.model.precision import PrecisionError
from swarmd.rebalance.mover import MoveFailed
from swarmd.stage.limits import StageLimits

JOB, ME, SUBMITTER = b"j" * 32, b"m" * 32, b"s" * 32
SPEC = JobSpec.from_dict({"name": "moves", "steps": 1, "model": {"arch": "transformer-lm", "d_model": 8, "n_heads": 2},
                          "data": {"tokens": "t.bin", "seq_len": 4}, "pipeline": {"stages": 3},
                          "batch": {"global_samples": 2, "microbatch_samples": 1}})  # serve() estimates its memory
QUICK = SimpleNamespace(sync_interval_s=0.01, progress_timeout_s=0.01)


class GatedService:
    """A stage service whose start waits until its stage's gate opens; every one built is recorded."""

    built: list["GatedService"] = []
    gates: dict[int, asyncio.Event] = {}

    def __init__(self, spec, job_id, stage, *args, **kwargs) -> None:
        self.spec, self.stage, self.state, self.committed = spec, stage, "joining", 0
        self.anchor = kwargs.get("anchor")  # what a move hands from the stage it leaves to the one it joins
        self.limits, self.executor = QUICK, SimpleNamespace(samples_per_s=1.0, depth=0)
        self.sync = SimpleNamespace(in_round=False)
        GatedService.built.append(self)

    async def start(self) -> None:
        await GatedService.gates.setdefault(self.stage, asyncio.Event()).wait()
        self.state = "serving"

    async def stop(self) -> None:
        self.state = "stopped"

    async def drain(self, timeout_s: float) -> bool:
        self.state = "draining"  # holds no work: drained at once
        return True

    def undrain(self) -> None:
        if self.state == "draining":
            self.state = "serving"

    def announcement(self) -> dict:
        return {"samples_per_s": 1.0, "queue": 0, "step": self.committed, "state": self.state}


class RecordingDHT:
    def announce(self, key, value_fn):
        return SimpleNamespace(key=key, value_fn=value_fn)

    async def withdraw(self, ann) -> int:
        return 1


@pytest.fixture
def serving(monkeypatch) -> Serving:
    monkeypatch.setattr(serving_module, "StageService", GatedService)
    GatedService.built, GatedService.gates = [], {0: asyncio.Event()}
    GatedService.gates[0].set()
    mates = {(JOB, 0): [StagePeer(b"x" * 32, "127.0.0.1:2", 0)], (JOB, 2): [StagePeer(b"y" * 32, "127.0.0.1:4", 2)]}
    serving = Serving(RecordingDHT(), None, None, StaticDirectory(mates), peer_id=ME, address="127.0.0.1:1",
                      device="cpu", state_dir=None, limits=StageLimits(), max_stages=4)
    old = GatedService(SPEC, JOB, 0)
    old.state = "serving"
    serving.served[(JOB, 0)] = Served(old, RecordingDHT().announce(b"k", old.announcement))
    return serving


class CountingLock(asyncio.Lock):
    """`Serving`'s join lock, counting who asked for it: a join blocked behind a move has asked."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    async def acquire(self) -> bool:
        self.asked += 1
        return await super().acquire()


def built_for(stage: int) -> int:
    return sum(s.stage == stage for s in GatedService.built)


async def test_a_move_during_a_join_is_skipped_and_leaves_everything_as_it_was(serving) -> None:
    gate = GatedService.gates[2] = asyncio.Event()
    join = asyncio.create_task(serving.serve(SPEC, JOB, 2, submitter=SUBMITTER))
    await until(lambda: built_for(2) == 1, 5, "the join to start its service")
    old = serving.served[(JOB, 0)].service
    with pytest.raises(MoveFailed, match="a join or leave is under way"):
        async with asyncio.timeout(5):
            await serving.move(JOB, 0, 2)
    assert old.state == "serving" and not serving.moving and not serving.moves
    gate.set()
    joined = await join
    assert serving.served[(JOB, 2)].service is joined and serving.served[(JOB, 0)].service is old
    assert built_for(2) == 1


async def test_a_join_during_a_move_waits_and_finds_the_moved_in_stage(serving) -> None:
    gate = GatedService.gates[2] = asyncio.Event()
    joins = serving._joins = CountingLock()
    move = asyncio.create_task(serving.move(JOB, 0, 2, drain_timeout_s=2.0))
    await until(lambda: built_for(2) == 1, 5, "the move to drain and join stage 2")
    join = asyncio.create_task(serving.serve(SPEC, JOB, 2, submitter=SUBMITTER))
    await until(lambda: joins.asked == 2, 5, "the join to ask for the lock the move holds")
    assert not join.done() and built_for(2) == 1  # waiting for the move, not starting a second service
    gate.set()
    record = await move
    joined = await join
    assert record.target == 2 and not record.error
    assert serving.served[(JOB, 2)].service is joined and (JOB, 0) not in serving.served
    assert built_for(2) == 1


class AnsweringProber:
    """The daemon's prober as far as a move sees it: which announced peers answered as serving (how a
    probe is made is tested in tests/jobs/test_jobs_probing*.py)."""

    def __init__(self, serving: set[bytes]) -> None:
        self.serving, self.asked = serving, []

    async def check(self, job_id, announced) -> Probe:
        self.asked.append(announced.peer_id)
        return Probe(True, True) if announced.peer_id in self.serving else UNANSWERED


async def test_a_move_does_not_leave_a_stage_to_a_peer_that_only_announced_itself(serving) -> None:
    """A stranger's stage-0 announcement pointing at nothing is not a peer that stays: the stage's only
    real peer keeps serving it (adversary R10)."""
    serving.prober = AnsweringProber({b"y" * 32})  # the stage-2 mate answers, the stage-0 "mate" does not
    old = serving.served[(JOB, 0)].service
    with pytest.raises(MoveFailed, match="no other peer of stage 0 answered"):
        await serving.move(JOB, 0, 2)
    assert old.state == "serving" and serving.served[(JOB, 0)].service is old and built_for(2) == 0
    assert serving.prober.asked == [b"x" * 32, b"y" * 32]


async def test_a_move_leaves_when_a_peer_that_answered_stays(serving) -> None:
    serving.prober = AnsweringProber({b"x" * 32, b"y" * 32})
    GatedService.gates[2] = asyncio.Event()
    GatedService.gates[2].set()
    record = await serving.move(JOB, 0, 2, drain_timeout_s=2.0)
    assert record.target == 2 and not record.error and (JOB, 0) not in serving.served


@pytest.mark.parametrize("error, expected", [(PrecisionError("compute.dtype fp16"), MoveFailed),
                                             (ValueError("a bug in the stage's start"), ValueError)])
async def test_a_new_stage_that_cannot_start_undoes_the_move_and_only_expected_errors_become_move_failed(
        serving, monkeypatch, error, expected) -> None:
    """A dtype this device cannot serve (PrecisionError) is a move that failed; any other error out
    of the new stage's start is a bug and goes up as itself (not dressed as MoveFailed). Either way
    the old stage serves again and the move is recorded with its error."""
    async def start(self) -> None:
        raise error

    monkeypatch.setattr(GatedService, "start", start)
    old = serving.served[(JOB, 0)].service
    with pytest.raises(expected):
        await serving.move(JOB, 0, 2, drain_timeout_s=1.0)
    assert old.state == "serving" and (JOB, 2) not in serving.served and serving.served[(JOB, 0)].service is old
    assert len(serving.moves) == 1 and str(error) in serving.moves[0].error
