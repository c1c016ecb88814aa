"""The gossip rounds under a Supervisor, over real loopback sockets: an error nobody foresaw in a
round (here the directory raising as a malformed DHT value once made it raise) no longer ends the
rounds for good: it is recorded, the rounds restart and the views still converge."""

from __future__ import annotations


import torch
from waiting import until

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.rebalance.gossip import GossipConfig, GossipService, OwnLoad
from swarmd.supervisor import Backoff, Faults, Supervisor
from transport.identity import Identity
from transport.rpc import Pool, Router, RpcConfig, RpcServer

torch.set_num_threads(1)

JOB = bytes(range(32))
FAST = GossipConfig(period_s=0.1, jitter=0.2, fanout=1, call_timeout_s=0.5, backoff_base_s=0.5,
                    backoff_max_s=2.0, inbound_rate_per_s=100.0, inbound_burst=20.0, members_ttl_s=0.05)


class Faulty(StaticDirectory):
    """The directory, raising on calls `failing` (as `int("oops")` did inside the old directory)."""

    def __init__(self, failing: range) -> None:
        super().__init__()
        self.calls, self.failing = 0, failing

    async def peers(self, job_id: bytes, stage: int) -> list[StagePeer]:
        self.calls += 1
        if self.calls in self.failing:
            raise ValueError("invalid literal for int() with base 10: 'oops'")
        return await super().peers(job_id, stage)


async def test_a_round_that_raises_is_restarted_and_the_views_converge() -> None:
    faults = Faults()
    supervisor = Supervisor("rebalancing", faults, Backoff(initial_s=0.01, max_s=0.05))
    identities = [Identity.from_seed(b"supervised-gossip-%d" % i) for i in range(2)]
    faulty, plain = Faulty(range(2, 5)), StaticDirectory()
    servers, pools, services = [], [], []
    try:
        for i, identity in enumerate(identities):
            rpc = RpcConfig(identity=identity)
            router = Router()
            servers.append(await RpcServer.serve_tcp(router, config=rpc))
            pools.append(Pool(rpc))
            services.append(GossipService(JOB, 1, identity, lambda i=i: OwnLoad(0, 1.0 + i, 0, "serving"), router,
                                          pools[-1], faulty if i == 0 else plain, FAST, supervisor=supervisor))
        members = [StagePeer(ident.peer_id, f"127.0.0.1:{s.port}", 0) for ident, s in zip(identities, servers)]
        for directory in (faulty, plain):
            directory.set(JOB, 0, members)
        for service in services:
            await service.start()
        def restarted():
            fault = faults.get(f"rebalancing: gossip rounds {JOB.hex()[:16]}")
            return fault if fault is not None and fault.restarts >= 3 and fault.retry_at is None else None

        fault = await until(restarted, 20, "three failed rounds to be restarted", interval=0.05,
                            detail=lambda: str(faults.status()))
        assert fault.last_error.startswith("ValueError: invalid literal")
        rounds = services[0].stats.rounds

        async def went_on() -> bool:
            return services[0].stats.rounds >= rounds + 3 and [len(await s.entries()) for s in services] == [2, 2]

        await until(went_on, 20, "the restarted rounds to go on", interval=0.05)
    finally:
        for service in services:
            await service.stop()
        for pool, server in zip(pools, servers):
            await pool.close()
            await server.close()
