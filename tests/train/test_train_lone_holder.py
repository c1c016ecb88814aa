"""A stage whose step went to one of its three peers: the holder commits alone, and the two mates
that held nothing share the old step and state, so each one's view contradicts the holder's lone
claim (adversary R2's rule) until `resume_after_s` of quiet. Meanwhile they list the holder's
microbatches `missing` and the trainer, counting them as voters, waits and re-sends. Before, each
re-send went to the wiring's favourite, the holder, which answers a step it committed as a replay
(adding nothing), again every `resend_grace_s`: with the limit set past the test's timeout, the job
stopped at step 1. Now a re-send avoids peers past the step, a mate takes it, covers the step and
commits it (its state then gives way to the agreed one by download). Believing the lone holder
instead would let a liar that took a trainer's whole step drop it (docs/trainer.md). Real stage
peers on loopback; the two mates refuse step 1's compute with `busy` until the holder has
committed it, as loaded peers do, so the trainer's wiring sends that step to the third."""

import asyncio
import dataclasses

from waiting import until

from swarmd.reference import ReferenceTrainer
from swarmd.stage.errors import busy
from swarmd.train.trainer import Trainer
from transport.message import Router
from transport.rpc import Pool

STEPS = 4
LONE_STEP = 1  # the step the holder gets alone
COMPUTE = {"stage.forward", "stage.backward", "stage.forward_backward"}
NEVER_S = 3600.0  # resume_after_s: longer than the test may take


class LoadedRouter(Router):
    """Its compute calls for LONE_STEP are answered `busy` until `holder` has committed that step."""

    def __init__(self, holder) -> None:
        super().__init__()
        self.holder = holder

    def unary(self, name, handler):
        async def maybe_busy(req):
            if name in COMPUTE and req.meta.get("step") == LONE_STEP and self.holder.service.committed <= LONE_STEP:
                raise busy("loaded (a test's refusal)")
            return await handler(req)

        super().unary(name, maybe_busy)


class RecordingPool(Pool):
    """The trainer's pool: which compute calls for a step reached the holder after it committed it."""

    def __init__(self, holder) -> None:
        super().__init__()
        self.holder = holder
        self.to_past: list[tuple[str, int]] = []

    async def call(self, addr, method, message, **kw):
        step = message.meta.get("step")
        if method in COMPUTE and addr == self.holder.addr and self.holder.service.committed > step:
            self.to_past.append((method, step))
        return await super().call(addr, method, message, **kw)


async def test_re_sends_go_to_the_mates_that_held_nothing_when_the_holder_committed_alone(tiny_job, swarm, kit):
    """Steps: a 2-stage job; stage 1 = A plus two mates B, C that answer step 1's compute `busy`
    until A has committed step 1 (so that step goes to A alone); resume_after_s = 1 h; 4 steps.
    Expected: no compute call for step 1 reaches A after its commit (a re-send avoids peers past
    the step; before, each went to A and was answered as a replay); every step commits with the
    single-process reference's loss; a mate committed step 1 itself, from the re-sends; in the end
    every stage-1 peer shows step 4 and one digest."""
    spec, data = tiny_job(steps=STEPS, stages=2)
    limits = dataclasses.replace(kit.STAGE_LIMITS, resume_after_s=NEVER_S)
    swarm_ = await swarm(spec, peers_per_stage=1, limits=limits)
    holder = swarm_.of_stage(1)[0]
    mates = [await swarm_.add_peer(1, bytes([1, k]) * 16, router=LoadedRouter(holder)) for k in (1, 2)]
    pool = RecordingPool(holder)
    try:
        trainer = Trainer(spec, kit.JOB_ID, swarm_.directory, pool, data, config=kit.TRAINER_CONFIG)
        events = await asyncio.wait_for(trainer.run(0, STEPS), timeout=60)
    finally:
        await pool.close()
    want = [r.loss for r in ReferenceTrainer(spec, data).train(STEPS)]
    print("losses", [e.global_loss for e in events], "reference", want, "to the holder past", pool.to_past)
    assert not [call for call in pool.to_past if call[1] == LONE_STEP], pool.to_past
    assert [e.step for e in events] == list(range(STEPS))
    for event, loss in zip(events, want):
        assert abs(event.global_loss - loss) <= 1e-4 * abs(loss)
    assert any(r.step == LONE_STEP for m in mates for r in m.service.records), [m.service.records for m in mates]
    # A mate whose own commit of a step lost the agreement downloads the agreed state (I2).
    stage1 = swarm_.of_stage(1)
    await until(lambda: {(p.service.committed, p.service.digest) for p in stage1} == {(STEPS, holder.service.digest)},
                30, "every stage-1 peer at the last step with one digest")
