"""A job ended swarm-wide on one stranger's word, over real loopback sockets.

A submitter whose trainers all run elsewhere ends its job ("done", a signed end record every
daemon obeys) once "every stage has a serving peer that committed the last step". Each stage's
step was the highest any one answering peer announced, so one stranger that announced itself in
every stage with `step = steps` and answered the probe (`stage.info` "serving") made the submitter
end a job its honest peers had trained 2 steps of 20: every daemon stopped serving and training it.
Now a stage's step is the lower median of its answering, serving peers' claims: a liar moves it
only by being most of the stage's answering peers.
"""

from __future__ import annotations

import pytest
from adversary_kit import JOB, spec

from swarmd.jobs.probing import Prober
from swarmd.jobs.registry import Job, JobRegistry
from swarmd.values import StageAnnouncement
from transport.identity import Identity
from transport.rpc import Message, Pool, Router, RpcConfig, RpcServer


class Announced:
    """The stage announcements a DHT read would return (the DHT is not what this is about)."""

    def __init__(self) -> None:
        self.by_stage: dict[int, list[StageAnnouncement]] = {}
        self.ends: list[bytes] = []

    async def announcements(self, job_id: bytes, stage: int, latest: bool = True) -> list[StageAnnouncement]:
        return list(self.by_stage.get(stage, []))

    def announce(self, key: bytes, value_fn):
        self.ends.append(value_fn())
        return key


async def stage_server(step: int) -> tuple[RpcServer, Identity]:
    """A peer that answers `stage.info` for every stage: serving, at `step`."""
    identity = Identity.generate()
    router = Router()

    async def info(req):
        return Message({"state": "serving", "step": step}, codec="none")

    router.unary("stage.info", info)
    return await RpcServer.serve_tcp(router, "127.0.0.1", 0, config=RpcConfig(identity=identity)), identity


@pytest.mark.parametrize("honest_per_stage", [1, 2])
async def test_one_liar_in_every_stage_does_not_end_the_job(honest_per_stage):
    """Each stage has `honest_per_stage` honest peers at step 2 and the liar at step 20 (= steps).
    Expected: the submitter does not end the job (before: ended "done" at step 20)."""
    job_spec = spec()
    servers = [await stage_server(2) for _ in range(honest_per_stage)] + [await stage_server(job_spec.steps)]
    pool = Pool(RpcConfig(identity=Identity.generate()))
    announced = Announced()
    try:
        for stage in range(job_spec.pipeline.stages):
            announced.by_stage[stage] = [
                StageAnnouncement(ident.peer_id, stage, f"127.0.0.1:{rpc.address[1]}", 10.0, 0, step, "serving", 2e9)
                for (rpc, ident), step in zip(servers, [2] * honest_per_stage + [job_spec.steps])]
        me = Identity.generate()
        registry = JobRegistry(announced, me, values=announced, prober=Prober(pool, me.peer_id))
        job = Job(JOB, job_spec, me.public_key, local=True)
        registry.jobs[JOB] = job
        assert await registry.swarm_step(job) == 2
        await registry.settle()
        assert job.ended is None and announced.ends == []
    finally:
        await pool.close()
        for rpc, _ in servers:
            await rpc.close()


async def test_a_stage_whose_answering_peers_finished_ends_the_job():
    """The honest end still comes: every answering peer of every stage at `steps`."""
    job_spec = spec()
    servers = [await stage_server(job_spec.steps) for _ in range(2)]
    pool = Pool(RpcConfig(identity=Identity.generate()))
    announced = Announced()
    try:
        for stage in range(job_spec.pipeline.stages):
            announced.by_stage[stage] = [
                StageAnnouncement(ident.peer_id, stage, f"127.0.0.1:{rpc.address[1]}", 10.0, 0, job_spec.steps,
                                  "serving", 2e9) for rpc, ident in servers]
        me = Identity.generate()
        registry = JobRegistry(announced, me, values=announced, prober=Prober(pool, me.peer_id))
        job = Job(JOB, job_spec, me.public_key, local=True)
        registry.jobs[JOB] = job
        await registry.settle()
        assert job.ended is not None and job.ended.state == "done" and job.ended.step == job_spec.steps
    finally:
        await pool.close()
        for rpc, _ in servers:
            await rpc.close()
