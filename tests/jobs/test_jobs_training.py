"""A daemon's trainer against its job's end: the race between `trainer.run()` and the end record,
with no daemon and no model (a stand-in trainer)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from swarmd.jobs import training
from swarmd.jobs.registry import Job
from swarmd.jobs.training import Training
from swarmd.train.errors import TrainerError
from swarmd.values import JobEnd


class StandIn:
    """A trainer that runs until `finish` is set, then returns or raises `error`."""

    shard = 0

    def __init__(self, error: BaseException | None = None) -> None:
        self.error, self.finish, self.started, self.cancelled = error, asyncio.Event(), asyncio.Event(), False

    async def run(self) -> None:
        self.started.set()
        try:
            await self.finish.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.error is not None:
            raise self.error


def a_job() -> Job:
    return Job(b"j" * 32, SimpleNamespace(name="j"), b"s" * 32, local=False)


async def racing(error: BaseException | None = None) -> tuple[Job, StandIn, asyncio.Task]:
    """A job, its stand-in trainer, and the race between them, once the trainer runs."""
    job, trainer = a_job(), StandIn(error)
    race = asyncio.create_task(Training._until_ended(job, trainer))
    await trainer.started.wait()
    return job, trainer, race


def end(job: Job, state: str) -> None:
    job.ended = JobEnd(state, 7, 0.0, "its submitter")
    job.end_seen.set()


@pytest.mark.parametrize("error", [None, TrainerError("a step lost"), KeyError("a bug"), TimeoutError()])
async def test_the_trainer_ending_first_ends_the_race_with_its_own_outcome(error) -> None:
    """Its return, or its own error as itself (a TrainerError must stay final for the supervisor,
    not arrive wrapped in a group; its own TimeoutError is not taken for the job's end)."""
    job, trainer, race = await racing(error)
    trainer.finish.set()
    if error is None:
        await race
    else:
        with pytest.raises(type(error)) as raised:
            await race
        assert raised.value is error
    assert not trainer.cancelled


async def test_a_cancelled_job_stops_its_trainer_at_once() -> None:
    job, trainer, race = await racing()
    end(job, "cancelled")
    await asyncio.wait_for(race, 5)
    assert trainer.cancelled


async def test_a_finished_job_gives_its_trainer_the_grace_to_see_the_last_commit(monkeypatch) -> None:
    """Ended done: the trainer may still finish within FINISH_GRACE_S (and is not cancelled); past
    the grace it is stopped."""
    monkeypatch.setattr(training, "FINISH_GRACE_S", 0.2)
    job, trainer, race = await racing()
    end(job, "done")
    await asyncio.sleep(0.05)
    trainer.finish.set()
    await race
    assert not trainer.cancelled
    job, trainer, race = await racing()
    end(job, "done")
    await asyncio.wait_for(race, 5)
    assert trainer.cancelled


async def test_cancelling_the_owner_cancels_the_trainer_and_propagates() -> None:
    job, trainer, race = await racing()
    race.cancel()
    with pytest.raises(asyncio.CancelledError):
        await race
    assert trainer.cancelled


async def test_a_job_ended_before_the_start_runs_no_trainer() -> None:
    job, trainer = a_job(), StandIn()
    end(job, "cancelled")
    await Training._until_ended(job, trainer)
    assert not trainer.started.is_set()
