"""Claims checked before they count (`swarmd.jobs.probing`), against real servers on loopback: a
stage peer counts once the announced address proved the announced peer id and answered
`stage.info`; a dead address, a server proving another id, or a peer saying it does not serve the
stage count as such. Answers are cached, so asking again costs no call."""

from __future__ import annotations

import math

from swarmd.jobs.probing import Prober
from swarmd.values import StageAnnouncement
from transport.errors import RpcError
from transport.identity import Identity
from transport.rpc import Message, Pool, Router, RpcConfig, RpcServer

JOB = b"\x05" * 32


async def stage_server(identity: Identity, state: str | None) -> RpcServer:
    """A peer answering `stage.info` with `state` (None: refusing, as a daemon not serving the stage)."""
    router = Router()

    async def info(req):
        if state is None:
            raise RpcError("not_found", "no such stage here")
        return Message({"step": 3, "state": state}, codec="none")

    router.unary("stage.info", info)
    return await RpcServer.serve_tcp(router, "127.0.0.1", 0, config=RpcConfig(identity=identity))


def announced(identity: Identity, addr: str, state: str = "serving") -> StageAnnouncement:
    return StageAnnouncement(identity.peer_id, 0, addr, 1e12, 0, 3, state, math.inf)


async def test_a_peer_counts_only_once_it_answered_as_itself() -> None:
    serving, idle, other = Identity.generate(), Identity.generate(), Identity.generate()
    servers = [await stage_server(serving, "serving"), await stage_server(idle, None)]
    me = Identity.generate()
    pool = Pool(RpcConfig(identity=me))
    try:
        addr = [f"{s.address[0]}:{s.address[1]}" for s in servers]
        prober = Prober(pool, me.peer_id, timeout_s=2.0)
        found = await prober.check_all(JOB, [
            announced(serving, addr[0]),  # answers as itself: serves
            announced(idle, addr[1]),  # answers as itself, does not serve the stage
            announced(other, addr[0]),  # a record pointing at somebody else's server
            announced(Identity.generate(), "127.0.0.1:9"),  # nothing listens there
        ])
        verdicts = [(p.answered, p.serving) for p in found.values()]
        assert verdicts == [(True, True), (True, False), (False, False), (False, False)]
        sent = prober.probes_sent
        assert (await prober.check(JOB, announced(serving, addr[0]))).serving and prober.probes_sent == sent
        assert (await prober.check(JOB, announced(me, "127.0.0.1:9"))).serving  # itself: no call
    finally:
        await pool.close()
        for server in servers:
            await server.close()


def test_an_answer_carries_the_peers_step_and_rate_checked_at_the_edge() -> None:
    """`swarmctl job` on a host that did not submit showed every stage peer at the step and rate of
    its announcement (re-stored every 30 s: `step 0, 0.0/s` at step 18); the probe's `stage.info`
    answer is seconds old, so it is what a peer row shows. A value out of the schema is dropped."""
    from swarmd.jobs.probing import answered
    from swarmd.values import MAX_STEP

    live = answered({"state": "serving", "step": 18, "samples_per_s": 42.5})
    assert (live.answered, live.serving, live.step, live.samples_per_s) == (True, True, 18, 42.5)
    for bad_step, bad_rate in ((-1, -3.0), ("18", float("nan")), (True, float("inf")), (MAX_STEP + 1, "fast"),
                               (18.0, None)):
        probe = answered({"state": "serving", "step": bad_step, "samples_per_s": bad_rate})
        assert probe.serving and probe.step is None and probe.samples_per_s is None
    assert answered(["not", "a", "map"]) == answered({}) and not answered({}).serving
    # An idle peer behind its mates (stage.info `behind`) serves its stage all the same.
    assert answered({"state": "behind", "step": 12}).serving
    assert not answered({"state": "joining", "step": 12}).serving


async def test_stage_rows_show_what_peers_answered_over_their_announcements() -> None:
    from types import SimpleNamespace

    from swarmd.jobs.probing import Probe
    from swarmd.jobs.registry import Job, JobRegistry

    peers = [Identity.generate().peer_id for _ in range(3)]
    found = [StageAnnouncement(pid, 0, f"127.0.0.1:{9 + i}", 0.0, 0, 0, "serving", math.inf)
             for i, pid in enumerate(peers)]

    class Announced:
        async def announcements(self, job_id, stage, latest=True):
            return list(found)

    class Probed:  # answered at step 18 and 5.0/s; answered out of schema; not answered
        async def check_all(self, job_id, announcements):
            verdicts = [Probe(True, True, 18, 5.0), Probe(True, True, None, None), Probe(False, False)]
            return {(a.peer_id, a.stage): v for a, v in zip(announcements, verdicts)}

    registry = JobRegistry(None, None, values=Announced(), prober=Probed())
    job = Job(JOB, SimpleNamespace(pipeline=SimpleNamespace(stages=1)), b"s" * 32, local=False)
    rows = (await registry.stage_peers(job))[0]["peers"]
    assert [(r["step"], r["samples_per_s"]) for r in rows] == [(18, 5.0), (0, 0.0), (0, 0.0)]
