"""Where a trainer that joins a running job starts, against one liar, over real loopback sockets.

A trainer started without a step (`swarmctl train`, a restarted daemon) starts at "the step every
stage has reached": per stage the highest step any one of its peers answers in `stage.info`. One
stranger announced in every stage, answering step 7 of a job of 8 steps, made the trainer start at
step 7; its calls for step 7 then made each honest stage, alone and with "evidence" from the liar
in the other stage, skip steps 0..6 (`StageService._resume_at`): the job trained one step of 8
and ended. Requested of race (swarmd/train/trainer.py `_swarm_step`, and R3b), "adversary R3" in
docs/security.md ("Adversary findings").

Closed: a stage's step is now the lower median of its answering (serving) peers' claims
(`progress.agreed_step`), so the liar beside one honest peer moves it nowhere.
"""

from __future__ import annotations

import asyncio

import torch
from adversary_kit import JOB, start_peer, training_job

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.stage import StageLimits
from swarmd.train.trainer import Trainer, TrainerConfig
from swarmd.train.wiring import WiringConfig
from transport.identity import Identity
from transport.rpc import Message, Pool, Router, RpcConfig, RpcServer

torch.set_num_threads(1)


LIMITS = StageLimits(sync_interval_s=0.02, progress_timeout_s=1.0, round_timeout_s=5.0, max_wait_s=5.0,
                     resume_after_s=1.0)
TRAINER = TrainerConfig(info_timeout_s=2.0, stage_info_timeout_s=1.0, refresh_s=0.5, wait_initial_s=0.01,
                        wait_max_s=0.2, commit_poll_s=0.01, commit_poll_max_s=0.05, resend_grace_s=1.0,
                        uncovered_grace_s=0.5, wiring=WiringConfig(seed=3))


async def step_liar(step: int) -> tuple[RpcServer, Identity]:
    """Answers `stage.info` for any stage: serving, at `step`; compute calls are unknown methods
    (the trainer bans it at its first call, which is after it chose where to start)."""
    identity = Identity.generate()
    router = Router()

    async def info(req):
        return Message({"step": step, "state": "serving", "missing": [], "uncovered": []}, codec="none")

    router.unary("stage.info", info)
    return await RpcServer.serve_tcp(router, "127.0.0.1", 0, config=RpcConfig(identity=identity)), identity


async def test_one_liar_in_every_stage_does_not_choose_where_a_trainer_starts(tmp_path):
    """One honest peer per stage at step 0 and the liar (step 7) announced in both stages; a
    trainer starts without a step. Expected: it trains steps 0..7 and no stage skips a step; on
    main it trains step 7 alone, both stages having skipped 0..6."""
    spec, data = training_job(tmp_path)
    directory = StaticDirectory()
    peers = [await start_peer(spec, stage, directory, LIMITS) for stage in range(2)]
    liar, identity = await step_liar(spec.steps - 1)
    for stage in range(2):
        directory.set(JOB, stage, [*await directory.peers(JOB, stage),
                                   StagePeer(identity.peer_id, f"127.0.0.1:{liar.address[1]}", stage)])
    pool = Pool(RpcConfig(identity=Identity.generate()))
    try:
        trainer = Trainer(spec, JOB, directory, pool, data, config=TRAINER)
        events = await asyncio.wait_for(trainer.run(), 60)
        assert [e.step for e in events] == list(range(spec.steps))
        assert not any(p.service.skipped for p in peers), [list(p.service.skipped) for p in peers]
    finally:
        await pool.close()
        await liar.close()
        for peer in peers:
            await peer.close()


async def test_one_liar_claiming_a_low_step_does_not_stop_a_joining_trainer(tmp_path):
    """The other direction: both stages trained to step 3 by a first trainer, then the liar
    (answering step 0, and nothing else) announced in both stages and a second trainer started
    without a step. The lower median of two claims is the liar's, so it starts at step 0. Expected:
    it still trains to the end: the liar is banned at its first compute call, after which the
    honest peers' `stale_step` (and replays) for steps 0..2 are confirmed by their own stages'
    step, and no honest peer is banned for them; steps 3..7 are trained as usual."""
    spec, data = training_job(tmp_path)
    directory = StaticDirectory()
    peers = [await start_peer(spec, stage, directory, LIMITS) for stage in range(2)]
    pool = Pool(RpcConfig(identity=Identity.generate()))
    liar, identity = await step_liar(0)
    try:
        first = Trainer(spec, JOB, directory, pool, data, config=TRAINER)
        await asyncio.wait_for(first.run(0, 3), 60)
        for stage in range(2):
            directory.set(JOB, stage, [*await directory.peers(JOB, stage),
                                       StagePeer(identity.peer_id, f"127.0.0.1:{liar.address[1]}", stage)])
        trainer = Trainer(spec, JOB, directory, pool, data, config=TRAINER)
        events = await asyncio.wait_for(trainer.run(), 60)
        assert [e.step for e in events][-5:] == list(range(3, spec.steps))
        assert all(p.service.committed == spec.steps for p in peers)
        assert not any(p.peer_id in trainer.wiring[stage].banned() for stage, p in enumerate(peers)), \
            [r.reason for r in trainer.banned_peers]
        assert not any(p.service.skipped for p in peers)
    finally:
        await pool.close()
        await liar.close()
        for peer in peers:
            await peer.close()
