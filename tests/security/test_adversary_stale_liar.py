"""A stage peer that answers every call `stale_step`, against a trainer, over real loopback sockets.

`stale_step` means "this stage already committed your step": the trainer believes it at once, from
any one peer, without asking anyone else. It stops routing the microbatch through that stage and
covers the stages above it with a zero output gradient (`Trainer._cover`). So one announced peer of
the last stage that answers `stale_step` to every `forward_backward` makes each microbatch routed to
it add a zero gradient at stage 0 (its samples counted: a silently wrong step), and the last stage
never receives it: it is this trainer's own share, which is re-sent only to stages it was sent to
and never taken over, so the step never commits. Requested of race (swarmd/train/trainer.py),
"adversary R8" in docs/security.md ("Adversary findings").

Closed: `stale_step` is believed only once the stage's agreed step (the lower median of its peers'
`stage.info` claims) is past the call's step; a peer whose own `stage.info` contradicts its
`stale_step` is banned, and the call goes elsewhere.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from adversary_kit import JOB, start_peer, training_job

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.reference import ReferenceTrainer
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


async def stale_liar(info_step: int = 0) -> tuple[RpcServer, Identity]:
    """A last-stage peer: every forward_backward is answered `stale_step`; `stage.info` says it
    serves at `info_step` (0: like an honest peer that has not committed yet)."""
    identity = Identity.generate()
    router = Router()

    async def stale(req):
        step = req.meta.get("step", 0)
        raise RpcError("stale_step", f"step {step} is already committed here; this peer is at step {step + 1}")

    async def info(req):
        return Message({"step": info_step, "state": "serving", "missing": [], "uncovered": []}, codec="none")

    router.unary("stage.forward_backward", stale)
    router.unary("stage.info", info)
    return await RpcServer.serve_tcp(router, "127.0.0.1", 0, config=RpcConfig(identity=identity)), identity


@pytest.mark.parametrize("info_step", [0, 1_000_000], ids=["info-contradicts", "info-agrees"])
async def test_a_stale_step_liar_neither_corrupts_nor_stalls_a_step(tmp_path, info_step: int):
    """Stages 0 and 1 have one honest peer each; the liar is announced in stage 1 too. One trainer
    runs steps 0 and 1. Expected: both steps commit within 40 s with the reference's losses and no
    answer lost; on main the trainer hangs on step 0.
    info-contradicts: its `stage.info` says step 0, contradicting its `stale_step` (it is banned or
    passed over). info-agrees: its `stage.info` backs its `stale_step` (it claims step 1,000,000),
    so it does not contradict itself; its claim is outvoted by its mate's (the lower median of two
    claims) and the call goes to the honest peer."""
    spec, data = training_job(tmp_path)
    directory = StaticDirectory()
    peers = [await start_peer(spec, stage, directory, LIMITS) for stage in range(2)]
    liar, identity = await stale_liar(info_step)
    directory.set(JOB, 1, [*await directory.peers(JOB, 1), StagePeer(identity.peer_id, f"127.0.0.1:{liar.address[1]}", 1)])
    pool = Pool(RpcConfig(identity=Identity.generate()))
    try:
        trainer = Trainer(spec, JOB, directory, pool, data, config=TRAINER)
        events = await asyncio.wait_for(trainer.run(0, 2), 40)
        want = [r.loss for r in ReferenceTrainer(spec, data).train(2)]
        assert [e.answers_lost for e in events] == [0, 0]
        for event, loss in zip(events, want):
            assert event.global_loss is not None and abs(event.global_loss - loss) <= 1e-4 * abs(loss)
    finally:
        await pool.close()
        await liar.close()
        for peer in peers:
            await peer.close()
