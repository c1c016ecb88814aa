"""The trainer's commit watch long-polls `stage.info` (`until_step`): it hears of a step's commit
when the commit happens, not at its next poll, and falls back to spaced polls when a peer has no
watch slot for it. Real stage peers on loopback (tests/train/conftest.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest

from swarmd.train.trainer import Trainer, TrainerConfig
from transport.rpc import Message

STEPS = 4


def count_info_calls(swarm_) -> Counter:
    """Per stage, the stage.info calls its peers answer from now on."""
    counts: Counter = Counter()
    for peer in swarm_.peers:
        answer = peer.service.info

        async def counting(req, answer=answer, stage=peer.stage):
            counts[stage] += 1
            return await answer(req)

        peer.service.info = counting
    return counts


async def test_the_commit_watch_waits_at_the_peers_instead_of_polling(tiny_job, swarm, pools, kit):
    """Steps: 2 stages of one peer each, whose sync loop ticks every 0.3 s, so a step commits up
    to 0.3 s after the trainer's last backward; train 4 steps, counting stage.info calls. Expected:
    every step's record is seen, with at most two stage.info calls per peer per step (one
    long-poll, answered at the commit); a watch polling every 10 ms doubling to 50 ms (the
    config's commit_poll_s and commit_poll_max_s) asks stage 0's peer ~5 times a step."""
    spec, data = tiny_job(stages=2, steps=STEPS)
    swarm_ = await swarm(spec, 1, dataclasses.replace(kit.STAGE_LIMITS, sync_interval_s=0.3))
    counts = count_info_calls(swarm_)
    (pool,) = pools(1)
    trainer = Trainer(spec, kit.JOB_ID, swarm_.directory, pool, data, config=kit.TRAINER_CONFIG)
    events = await asyncio.wait_for(trainer.run(0, STEPS), 120)
    assert [e.step for e in events] == list(range(STEPS))
    assert all(e.stage_samples == (spec.batch.global_samples,) * 2 for e in events)
    assert max(counts.values()) <= 2 * STEPS, dict(counts)


async def test_with_no_watch_slot_free_the_commit_watch_polls(tiny_job, swarm, pools, kit):
    """Steps: every peer has one watcher slot (max_watchers 1), held throughout by a stranger's
    long-poll for a step far ahead; train 3 steps. Expected: the trainer's long-polls are answered
    at once as plain stage.info, and the watch still sees every commit and its record, polling
    (rounds that come back at once start at least commit_poll_s, 10 ms, apart: never a busy loop,
    which over loopback asks each peer hundreds of times a second)."""
    spec, data = tiny_job(stages=2, steps=3)
    swarm_ = await swarm(spec, 1, dataclasses.replace(kit.STAGE_LIMITS, max_watchers=1, max_wait_s=600.0))
    stranger, trainer_pool = pools(2)
    far = [asyncio.create_task(stranger.call(peer.addr, "stage.info", Message(
        {"job": kit.JOB_ID, "stage": peer.stage, "until_step": 10**6, "wait_s": 600.0}, codec="none"), timeout=700))
        for peer in swarm_.peers]
    try:
        async with asyncio.timeout(10):
            while not all(peer.service.watchers.total == 1 for peer in swarm_.peers):
                await asyncio.sleep(0.01)
        counts = count_info_calls(swarm_)
        loop = asyncio.get_running_loop()
        began = loop.time()
        trainer = Trainer(spec, kit.JOB_ID, swarm_.directory, trainer_pool, data, config=kit.TRAINER_CONFIG)
        events = await asyncio.wait_for(trainer.run(0, 3), 120)
        assert [e.stage_samples for e in events] == [(spec.batch.global_samples,) * 2] * 3
        assert not any(task.done() for task in far)  # the stranger's watches held their slots throughout
        spacing = kit.TRAINER_CONFIG.commit_poll_s
        assert 0 < max(counts.values()) <= (loop.time() - began) / spacing + 2 * 3, dict(counts)
    finally:
        for task in far:
            task.cancel()
        await asyncio.gather(*far, return_exceptions=True)


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_commit_wait_s_is_checked(bad):
    TrainerConfig(commit_wait_s=0.0)  # plain polls
    with pytest.raises(ValueError, match="commit_wait_s"):
        TrainerConfig(commit_wait_s=bad)
