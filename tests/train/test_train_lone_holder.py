"""A stage whose every step goes to one of its three peers: the holder commits alone, and the two
mates that held nothing share the old step and state, so each one's view contradicts the holder's
lone claim (adversary R2's rule): they believe it only after `resume_after_s`. Before, the trainer
counted them as voters (the stage's lower median) and waited for them: with the limit set past the
test's timeout, the job stopped at step 1. Now it counts the stage committed once every peer that
took its microbatches there is past the step (`Trainer._taken_past`). Real stage peers on
loopback; the two mates refuse compute with `busy` from step 1 on, as loaded peers do, so the
trainer's wiring sends everything to the third."""

import asyncio
import dataclasses

from swarmd.reference import ReferenceTrainer
from swarmd.stage.errors import busy
from swarmd.train.events import StepEvent
from swarmd.train.trainer import Trainer
from transport.message import Router

STEPS = 4
COMPUTE = {"stage.forward", "stage.backward", "stage.forward_backward"}
NEVER_S = 3600.0  # resume_after_s: longer than the test may take


class RefusingRouter(Router):
    """Its compute calls are answered `busy` while `refusing` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.refusing = asyncio.Event()

    def unary(self, name, handler):
        async def maybe_busy(req):
            if name in COMPUTE and self.refusing.is_set():
                raise busy("loaded (a test's refusal)")
            return await handler(req)

        super().unary(name, maybe_busy)


async def test_mates_that_held_nothing_follow_a_holder_that_committed_alone(tiny_job, swarm, pools, kit):
    """Steps: a 2-stage job; stage 1 = A plus two mates B, C whose compute is refused from step 1
    on (every microbatch then goes to A); resume_after_s = 1 h; 4 steps. Expected: every step
    commits within the test's timeout with the single-process reference's loss (exactly once),
    and A, which took every microbatch, has committed all 4 steps."""
    spec, data = tiny_job(steps=STEPS, stages=2)
    limits = dataclasses.replace(kit.STAGE_LIMITS, resume_after_s=NEVER_S)
    swarm_ = await swarm(spec, peers_per_stage=1, limits=limits)
    routers = [RefusingRouter(), RefusingRouter()]
    for k, router in enumerate(routers, start=1):
        await swarm_.add_peer(1, bytes([1, k]) * 16, router=router)

    def on_event(event) -> None:
        if isinstance(event, StepEvent) and event.step == 0:
            for router in routers:
                router.refusing.set()

    trainer = Trainer(spec, kit.JOB_ID, swarm_.directory, pools(1)[0], data, config=kit.TRAINER_CONFIG,
                      on_event=on_event)
    events = await asyncio.wait_for(trainer.run(0, STEPS), timeout=60)
    want = [r.loss for r in ReferenceTrainer(spec, data).train(STEPS)]
    print("losses", [e.global_loss for e in events], "reference", want)
    assert [e.step for e in events] == list(range(STEPS))
    for event, loss in zip(events, want):
        assert abs(event.global_loss - loss) <= 1e-4 * abs(loss)
    assert swarm_.of_stage(1)[0].service.committed == STEPS
