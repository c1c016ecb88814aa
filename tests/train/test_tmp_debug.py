"""Trainers driving real stage peers (StageServer + StageService) over loopback TCP, in one process,
against the single-process reference trainer. The swarm all-reduces in fp32 (conftest's
STAGE_LIMITS: allreduce_codec "none") except where a test says otherwise."""

import asyncio
import dataclasses
import math

import pytest
import torch

from swarmd.reference import ReferenceTrainer
from swarmd.stage import StageLimits
from swarmd.train.trainer import Trainer

pytestmark = pytest.mark.slow


async def test_a_peer_announced_mid_run_is_found_and_used(tiny_job, swarm, pools, kit):
    """Steps: 2 stages × 1 peer, one trainer, 12 steps in one `run`; after step 1 commits, a second
    peer of stage 0 starts (downloading the stage's state from its mate) and is announced.
    Expected: the trainer's background refresher finds it within `refresh_s`, the wiring sends it
    work (the trainer measured its speed), it commits every remaining step with its mate, and all
    12 losses and the final parameters still equal the reference's."""
    spec, data = tiny_job(optim="sgd", lr=0.1, stages=2, steps=12)
    swarm_ = await swarm(spec, peers_per_stage=1)
    committed = asyncio.Event()

    def on_event(event):
        if getattr(event, "step", -1) == 1:
            committed.set()

    trainer = Trainer(spec, kit.JOB_ID, swarm_.directory, pools(1)[0], data, config=kit.TRAINER_CONFIG,
                      on_event=on_event)
    task = asyncio.create_task(trainer.run(0, 12))
    await asyncio.wait_for(committed.wait(), 30)
    newcomer = await swarm_.add_peer(0, b"\x99" * 32)
    events = await asyncio.wait_for(task, 60)
    assert [e.step for e in events] == list(range(12))
    import time as _t
    w=trainer.wiring[0]
    print("DEBUG", [e.peers_per_stage for e in events], {k.hex()[:4]: (s._count, [round(x*1000,2) for x in s._recent]) for k,s in w._speed.items()}, [k.hex()[:4] for k in w.withheld(_t.time())], w._probe_at, w._benched, w._bans, newcomer.service.committed)
    assert events[-1].peers_per_stage == (2, 1)
    assert trainer.wiring[0].samples_per_s(newcomer.peer_id) < math.inf
    assert newcomer.service.committed == 12
    reference = ReferenceTrainer(spec, data)
    for e, r in zip(events, reference.train(12)):
        assert abs(e.global_loss - r.loss) <= 1e-5 * r.loss
    worst = kit.max_relative_difference(swarm_, reference)
    print(f"peer joined mid-run: max relative difference {worst:.2e}")
    assert worst <= 1e-5


