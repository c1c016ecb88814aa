"""The trainer without a swarm: argument checks, and waiting (not hanging) when a stage has no peers."""

import asyncio

import pytest

from swarmd.directory import StaticDirectory
from swarmd.train.events import StatusEvent
from swarmd.train.trainer import Trainer, TrainerConfig
from transport.rpc import Pool

JOB = b"\x07" * 32


def test_shards_and_config_are_checked(tiny_job):
    spec, data = tiny_job()
    with pytest.raises(ValueError, match="shard must be"):
        Trainer(spec, JOB, StaticDirectory(), Pool(), data, shard=2, shards=2)
    with pytest.raises(ValueError, match="shards must be in 1..4"):
        Trainer(spec, JOB, StaticDirectory(), Pool(), data, shard=0, shards=5)
    with pytest.raises(ValueError, match="forward_timeout_s"):
        TrainerConfig(forward_timeout_s=0)
    with pytest.raises(ValueError, match="stage_info_straggler_s"):
        TrainerConfig(stage_info_straggler_s=0)
    with pytest.raises(ValueError, match="stage_info_skip_max_s must be >= stage_info_skip_s"):
        TrainerConfig(stage_info_skip_s=10.0, stage_info_skip_max_s=5.0)
    trainer = Trainer(spec, JOB, StaticDirectory(), Pool(), data, shard=1, shards=3)
    assert trainer.my_microbatches() == [1]


async def test_a_stage_without_peers_is_a_clear_status_not_a_hang(tiny_job):
    """No stage has any peer: `run` waits with status "stage 0 has no peers", emits it as an event,
    keeps re-reading the directory (with backoff) and stops promptly when cancelled."""
    spec, data = tiny_job()
    directory = StaticDirectory()
    reads = 0
    original = directory.peers

    async def counting(job_id, stage):
        nonlocal reads
        reads += 1
        return await original(job_id, stage)

    directory.peers = counting
    events = []
    pool = Pool()
    trainer = Trainer(spec, JOB, directory, pool, data, config=TrainerConfig(wait_initial_s=0.01, wait_max_s=0.05),
                      on_event=events.append)
    task = asyncio.create_task(trainer.run(0, 1))
    for _ in range(200):  # the first stage build warms torch up: seconds on a loaded machine
        await asyncio.sleep(0.05)
        if trainer.status:
            break
    reads_then = reads
    await asyncio.sleep(0.5)
    assert trainer.status == "stage 0 has no peers"
    assert StatusEvent("stage 0 has no peers") in events
    assert reads - reads_then >= 5  # still polling the directory, not stuck
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2.0)
    await pool.close()
