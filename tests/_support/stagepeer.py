"""A stage peer in this process on loopback, as a daemon runs one: its own Router, RpcServer, Pool and
StageService, announced in a directory once it serves. The stage tests and the adversary tests
(tests/_support/adversary_kit.py) start theirs with it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swarmd.directory import StagePeer, StaticDirectory
from swarmd.stage import StageLimits, StageService
from transport.identity import Identity
from transport.rpc import Pool, Router, RpcConfig, RpcServer


@dataclass
class Peer:
    service: StageService
    rpc: RpcServer
    pool: Pool
    identity: Identity | None = None  # with one, its connections prove it and its peer id is the identity's

    @property
    def peer_id(self) -> bytes:
        return self.service.peer_id

    @property
    def addr(self) -> str:
        host, port = self.rpc.address
        return f"{host}:{port}"

    async def close(self) -> None:
        await self.service.stop()
        await self.rpc.close()
        await self.pool.close()


async def start_stage_peer(spec, job_id: bytes, stage: int, directory: StaticDirectory, limits: StageLimits, *,
                           peer_id: bytes | None = None, identity: Identity | None = None,
                           state_dir: Path | None = None, router: Router | None = None, announce: bool = True,
                           anchor=None, device: str = "cpu") -> Peer:
    """A peer of `stage` listening on 127.0.0.1:0, announced in `directory` once it serves (unless not
    `announce`). Its peer id is `identity`'s when it has one (its server and pool then prove it),
    else `peer_id`; `anchor` stands for the job's submitter's signed progress (`swarmd.stage.resume`)."""
    if identity is not None:
        peer_id = identity.peer_id
    assert peer_id is not None, "a stage peer needs a peer id or an identity"
    config = RpcConfig(identity=identity)
    router = router or Router()
    rpc = await RpcServer.serve_tcp(router, "127.0.0.1", 0, config=config)
    pool = Pool(config)
    addr = f"{rpc.address[0]}:{rpc.address[1]}"
    service = StageService(spec, job_id, stage, peer_id, router, pool, directory, address=addr, limits=limits,
                           state_dir=state_dir, anchor=anchor, device=device)
    await service.start()
    if announce:
        announced = await directory.peers(job_id, stage)
        directory.set(job_id, stage, [*announced, StagePeer(peer_id, addr, stage)])
    return Peer(service, rpc, pool, identity)
