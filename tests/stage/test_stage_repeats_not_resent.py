"""A stage peer that answers a trainer's re-send as a repeat (it already holds that microbatch) is
believed: the trainer does not re-send it again while that peer answers at the step, however long
a stage-mate's report keeps calling it missing. Once a run showed 79 refused repeats of one step:
every `resend_grace_s` the same microbatches went to a peer that held them. Real trainer, real
stage peer, over loopback; the lagging mate is played by the test (its report never changes)."""

from __future__ import annotations

import asyncio


from jobspec import job_spec

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.job import parse_toml
from swarmd.job.sources import open_training_data
from swarmd.train import Trainer, TrainerConfig
from swarmd.train.wiring import WiringConfig
from transport.errors import RpcError
from transport.rpc import Message, Pool, Request, Router, RpcServer

LAGGING = b"\xfe" * 32
# Re-sends allowed every 50 ms, polls (long-polls waiting 20 ms) every 20 ms at most: without the
# rule, dozens of repeats.
CONFIG = TrainerConfig(forward_timeout_s=20.0, backward_timeout_s=20.0, info_timeout_s=2.0, refresh_s=0.5,
                       wait_initial_s=0.01, wait_max_s=0.05, commit_poll_s=0.01, commit_poll_max_s=0.02,
                       commit_wait_s=0.02, resend_grace_s=0.05, uncovered_grace_s=60.0, wiring=WiringConfig(seed=3))
POLLS_AFTER = 40


class LaggingMate:
    """A stage peer whose report is stuck: it says this trainer's microbatches are `missing` (held
    by a peer that left, as far as it knows) and it takes no work (`busy`)."""

    def __init__(self, missing: list[int]) -> None:
        self.missing = missing
        self.infos = 0
        self.polled = asyncio.Event()
        self.router = Router()
        self.router.unary("stage.info", self.info)
        self.router.unary("stage.forward_backward", self.busy)

    async def info(self, req: Request) -> Message:
        self.infos += 1
        self.polled.set()
        return Message({"step": 0, "state": "serving", "missing": self.missing, "uncovered": []}, codec="none")

    async def busy(self, req: Request) -> Message:
        raise RpcError("busy", "lagging mate takes no work")


async def test_a_resend_answered_as_a_held_repeat_is_not_sent_again(kit, client, tmp_path):
    """Steps: a one-stage job of 4 microbatches; the trainer is shard 0 of 2 (microbatches 0 and
    2), the peer A gets them; a lagging mate keeps reporting 0 and 2 missing. The trainer re-sends
    them, A answers `duplicate: true`; the test lets the trainer poll the mate 40 more times, then
    sends shard 1's microbatches to A itself so the step commits.
    Expected: A refused exactly 2 repeats of step 0 (one per re-sent microbatch, not one per
    resend_grace_s), the step commits, and the trainer's step event shows no microbatch summed
    twice."""
    (tmp_path / "data.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    spec = parse_toml(job_spec("repeats", seed=4, steps=1, corpus=tmp_path / "data.txt",
                               model={"n_heads": 4, "vocab": None}, batch={"global_samples": 8},
                               wire={"activations": "none", "gradients": "none"}, pipeline={"stages": 1}))
    data = open_training_data(spec.data, spec.batch, spec.model.config.vocab, spec.seed, tmp_path)
    directory = StaticDirectory()
    peer = await kit.start_peer(spec, 0, 1, directory, kit.FAST)
    mate = LaggingMate([0, 2])
    rpc = await RpcServer.serve_tcp(mate.router, "127.0.0.1", 0)
    directory.set(kit.JOB, 0, [*await directory.peers(kit.JOB, 0),
                               StagePeer(LAGGING, f"{rpc.address[0]}:{rpc.address[1]}", 0)])
    pool = Pool()
    trainer = Trainer(spec, kit.JOB, directory, pool, data, shard=0, shards=2, config=CONFIG)
    try:
        training = asyncio.create_task(trainer.run(0, 1))
        async with asyncio.timeout(60):
            while peer.service.core.repeats(0) < 2:
                assert not training.done()
                await asyncio.sleep(0.01)
            seen = mate.infos
            while mate.infos < seen + POLLS_AFTER:
                mate.polled.clear()
                await mate.polled.wait()
            assert peer.service.core.repeats(0) == 2
            for index in (1, 3):
                mb = data.microbatch(0, index)
                await client.call(peer.addr, "stage.forward_backward",
                                  Message({**kit.meta(0), "step": 0, "mb": mb.id, "samples": len(mb.sample_indices)},
                                          [mb.inputs, mb.targets], codec="none"), timeout=10)
            events = await training
        assert [e.step for e in events] == [0] and events[0].duplicates == (0,)
        record = peer.service.records[-1]
        assert (record.samples, record.summed_duplicates, record.dropped_repeats) == (8, 0, 2)
    finally:
        await pool.close()
        await rpc.close()
        await peer.close()
