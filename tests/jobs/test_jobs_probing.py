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
