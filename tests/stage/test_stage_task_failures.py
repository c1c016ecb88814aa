"""A stage's one-shot tasks (a checkpoint write, an all-reduce round) are not restarted, but one that
fails with an unexpected error is shown in the stage supervisor's faults, as its loops' are."""

from __future__ import annotations

import asyncio

from waiting import until

from swarmd.directory import StaticDirectory
from swarmd.stage import StageLimits


async def test_a_failed_task_of_the_stage_is_shown_in_its_supervisors_faults(kit):
    """Steps: a stage spawns a task (as it does a checkpoint write or a round) that fails with an
    unexpected error. Expected: the failure is in the stage supervisor's faults, which `swarmctl
    status` shows (before: one log line, nothing in the status)."""
    spec = kit.make_spec(stages=3)
    peer = await kit.start_peer(spec, 1, 1, StaticDirectory(), StageLimits(sync_interval_s=60.0))
    try:
        async def broken() -> None:
            raise OSError("No space left on device")

        task = peer.service.spawn(broken(), "checkpoint")
        await asyncio.wait([task])
        await until(lambda: peer.service.supervisor.faults.total == 1, 5, "the failure recorded")
        [fault] = peer.service.supervisor.faults.status()["tasks"]
        assert "checkpoint" in fault["task"] and "No space left" in fault["last_error"], fault
    finally:
        await peer.service.stop()
        await peer.rpc.close()
        await peer.pool.close()
