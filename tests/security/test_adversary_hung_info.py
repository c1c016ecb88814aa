"""A stage peer that never answers `stage.info` (a hung or hostile peer, announced in every stage)
against a trainer's commit watch, over real loopback sockets.

The commit watch asks every announced peer of every pending stage at once and waits for all of
them, each for `stage_info_timeout_s`; a peer that times out is neither banned nor benched (it may
be merely overloaded), so it is asked again at the next poll and every poll lasts the whole
timeout. One such peer per stage, which also answers every compute call `busy` so the trainer's
routing never benches it, adds a timeout or two to every step. Requested of race
(swarmd/train/trainer.py), "adversary R5" in docs/security.md ("Adversary findings").

Closed: once one peer of a stage answered, the others get `stage_info_straggler_s` more, and a
peer that did not answer in time is not asked for `stage_info_skip_s` (doubling per further miss).
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
INFO_TIMEOUT_S = 2.0
TRAINER = TrainerConfig(info_timeout_s=2.0, stage_info_timeout_s=INFO_TIMEOUT_S, refresh_s=0.5, wait_initial_s=0.01,
                        wait_max_s=0.2, commit_poll_s=0.01, commit_poll_max_s=0.05, resend_grace_s=1.0,
                        uncovered_grace_s=0.5, wiring=WiringConfig(seed=3))


async def hung_peer() -> tuple[RpcServer, Identity]:
    """Answers compute calls `busy` at once and `stage.info` never."""
    identity = Identity.generate()
    router = Router()

    async def never(req):
        await asyncio.sleep(3600)

    async def busy(req):
        raise RpcError("busy", "always")

    router.unary("stage.info", never)
    for method in ("stage.forward", "stage.backward", "stage.forward_backward"):
        router.unary(method, busy)
    return await RpcServer.serve_tcp(router, "127.0.0.1", 0, config=RpcConfig(identity=identity)), identity


async def test_a_hung_peer_in_every_stage_does_not_add_a_timeout_to_every_step(tmp_path):
    """Three steps without the hung peer, then three with it announced in both stages. Expected:
    the three steps with it take less than one stage_info_timeout_s (2 s) longer in all than the
    three without; on main every poll of the commit watch waits the whole timeout (measured:
    0.19 s alone, 12.2 s with it)."""
    spec, data = training_job(tmp_path)
    directory = StaticDirectory()
    peers = [await start_peer(spec, stage, directory, LIMITS) for stage in range(2)]
    hung, identity = await hung_peer()
    pool = Pool(RpcConfig(identity=Identity.generate()))
    loop = asyncio.get_running_loop()
    try:
        trainer = Trainer(spec, JOB, directory, pool, data, config=TRAINER)
        began = loop.time()
        await asyncio.wait_for(trainer.run(0, 3), 60)
        plain = loop.time() - began
        for stage in range(2):
            current = await directory.peers(JOB, stage)
            directory.set(JOB, stage, [*current, StagePeer(identity.peer_id, f"127.0.0.1:{hung.address[1]}", stage)])
        trainer = Trainer(spec, JOB, directory, pool, data, config=TRAINER)
        began = loop.time()
        await asyncio.wait_for(trainer.run(3, 6), 120)
        attacked = loop.time() - began
        print(f"3 steps: {plain:.2f} s alone, {attacked:.2f} s with a hung peer in every stage")
        assert attacked - plain < INFO_TIMEOUT_S
    finally:
        await pool.close()
        await hung.close()
        for peer in peers:
            await peer.close()
