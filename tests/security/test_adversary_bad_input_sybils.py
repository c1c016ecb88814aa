"""Stage peers that refuse every input `bad_input`, against a trainer, over real loopback sockets.

A trainer blames its own input once `max_bad_input` (3) peers of a stage refused it as bad_input,
and raises `InputRefused`, a TrainerError: the daemon's supervisor then fails the job's trainer
for good. Peer ids are free, so a stranger announcing a few identities in the last stage, each
answering every `forward_backward` `bad_input`, kills the trainers of the job however many honest
peers serve that stage (five here beside one honest peer; each trainer call meets three of them
first about half the time). Requested of race (swarmd/train/trainer.py), "adversary R9" in
docs/security.md ("Adversary findings").

Closed: the input is blamed only when `max_bad_input` peers refused it and one of them had served
this trainer, or when every unbanned peer of the stage refused it; a refuser of an input a
stage-mate then accepts is banned.
"""

from __future__ import annotations

import asyncio

import torch
from adversary_kit import JOB, start_peer, training_job

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.stage import StageLimits
from swarmd.train.trainer import Trainer, TrainerConfig
from swarmd.train.wiring import WiringConfig
from transport.errors import RpcError
from transport.identity import Identity
from transport.rpc import Message, Pool, Router, RpcConfig, RpcServer

torch.set_num_threads(1)


LIMITS = StageLimits(sync_interval_s=0.02, progress_timeout_s=1.0, round_timeout_s=5.0, max_wait_s=5.0)
TRAINER = TrainerConfig(info_timeout_s=2.0, stage_info_timeout_s=1.0, refresh_s=0.5, wait_initial_s=0.01,
                        wait_max_s=0.2, commit_poll_s=0.01, commit_poll_max_s=0.05, resend_grace_s=1.0,
                        uncovered_grace_s=0.5, wiring=WiringConfig(seed=3))
SYBILS = 5


async def refuser() -> tuple[RpcServer, Identity]:
    identity = Identity.generate()
    router = Router()

    async def refuse(req):
        raise RpcError("bad_input", "targets: expected int64[4, 16]")

    async def info(req):
        return Message({"step": 0, "state": "serving", "missing": [], "uncovered": []}, codec="none")

    router.unary("stage.forward_backward", refuse)
    router.unary("stage.info", info)
    return await RpcServer.serve_tcp(router, "127.0.0.1", 0, config=RpcConfig(identity=identity)), identity


async def test_sybils_refusing_every_input_do_not_kill_the_trainer(tmp_path):
    """Stage 0: one honest peer; stage 1: one honest peer and five refusers. One trainer runs
    steps 0..3. Expected: every step commits (the refusers banned or passed over); on main the
    trainer raises InputRefused ("3 peers of stage 1 refused microbatch ...")."""
    spec, data = training_job(tmp_path)
    directory = StaticDirectory()
    peers = [await start_peer(spec, stage, directory, LIMITS) for stage in range(2)]
    sybils = [await refuser() for _ in range(SYBILS)]
    directory.set(JOB, 1, [*await directory.peers(JOB, 1),
                           *(StagePeer(ident.peer_id, f"127.0.0.1:{rpc.address[1]}", 1) for rpc, ident in sybils)])
    pool = Pool(RpcConfig(identity=Identity.generate()))
    try:
        trainer = Trainer(spec, JOB, directory, pool, data, config=TRAINER)
        events = await asyncio.wait_for(trainer.run(0, 4), 60)
        assert [e.step for e in events] == [0, 1, 2, 3]
    finally:
        await pool.close()
        for rpc, _ in sybils:
            await rpc.close()
        for peer in peers:
            await peer.close()
